"""Device meshes, the logical-axis -> mesh-axis table, and parallel execution strategies."""
