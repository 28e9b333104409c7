#!/usr/bin/env python3
"""Print the 2^(k/128) table of kernels/src/cpu/exp.rs (EXP_TAB).

The table-driven exp of glibc >= 2.28 (from Arm's optimized-routines) splits
x = k ln2/128 + r and reads 2^(k/128) from a table of 128 pairs:
  tab[2k]   = bits of T_k, where 2^(k/128) = H_k (1 + T_k) to double precision,
  tab[2k+1] = bits of H_k (2^(k/128) rounded to the nearest double) - (k << 45).
This script computes both from 60-digit decimal arithmetic (Python's float()
of a Decimal rounds correctly), so the table is derived here, not copied.
kernels/src/cpu/exp.rs's tests check the result: exp over every f32 input
in the range replay uses equals the C library's exp bit for bit.
"""
from decimal import Decimal, getcontext
import struct

getcontext().prec = 60


def bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


lines = []
for k in range(128):
    v = Decimal(2) ** (Decimal(k) / Decimal(128))
    h = float(v)
    t = float((v - Decimal(h)) / Decimal(h))
    lines.append(f"    0x{bits(t):016x}, 0x{(bits(h) - (k << 45)) & (2**64 - 1):016x},")
print("\n".join(lines))
