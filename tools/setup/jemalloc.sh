#!/bin/sh
# Prints the path of jemalloc's shared library (libjemalloc.so.2: the Debian package
# libjemalloc2, which `make system-packages` installs), or nothing where the machine has
# none. The Makefile's test stages preload it (LD_PRELOAD) in place of glibc's malloc.
arch=$(uname -m)
for ldconfig in ldconfig /sbin/ldconfig /usr/sbin/ldconfig; do
  command -v "$ldconfig" >/dev/null 2>&1 || continue
  found=$("$ldconfig" -p 2>/dev/null | awk '$1 == "libjemalloc.so.2" && $NF ~ /^\// { print $NF }')
  # this machine's architecture first (a multiarch system may list another's)
  { echo "$found" | grep -F "$arch"; echo "$found"; } | awk 'NF { print; exit }'
  exit 0
done
