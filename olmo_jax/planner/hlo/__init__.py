"""The planner's one reader of HLO text and XLA's dumps: every regular expression over them
in olmo_jax lives in this package (tests/planner/test_hlo_reader.py checks).

  parse.py           modules, computations, instructions (opcode, type, operands,
                     attributes, called computations) and their execution counts
  array_types.py     type strings: arrays, dimensions, dtypes and bytes
  backend_config.py  fields of XLA:GPU's backend_config and of kernel calls
  metadata.py        op_name paths: named scopes, arguments, lax.cond scopes
  dumps.py           the live-range report and the buffer assignment
"""

from olmo_jax.planner.hlo.parse import HloModule, Instruction, hlo_text, num_partitions, parse_module

__all__ = ["HloModule", "Instruction", "hlo_text", "num_partitions", "parse_module"]
