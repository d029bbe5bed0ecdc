#!/usr/bin/env python3
"""Ground truth for kvmesh-kernels' GGUF block decoding, from gguf-py.

Writes kernels/tests/data/gguf_quants.bin: for every weight format the
quantized kernels run (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K,
Q4_K, Q5_K, Q6_K, MXFP4), a few rows of blocks and the f32 values
`gguf.quants.dequantize` gives for them.

Rows come from `gguf.quants.quantize` where gguf-py can quantize the type
(F16, BF16, the legacy formats and MXFP4), plus one row of random block
bytes with sane f16 scales for every quantized type (the only rows of the
K-quants, which gguf-py cannot quantize): random bytes reach every quant
value and every bit of the packed scales, which a quantizer's output may
not. MXFP4's random rows take every e8m0 exponent byte from 0 to 252 (the
largest whose products stay finite: 12 * 2^(252 - 128) < 2^128), the
subnormal scales of bytes 0 and 1 included.
Formats added later are appended, so the rows of the earlier ones stay the
same bytes.

File format (little-endian): b"KVQF", u32 version (1), u32 entry count;
per entry: u32 GGML type id, u32 rows, u32 cols, u32 byte count, the
blocks (rows * cols / block values * block bytes), then rows * cols f32.

Deterministic (fixed seed): two runs give the same bytes.
    python3 scripts/golden/make_quant_fixtures.py [--out PATH]
"""

import argparse
import struct
import sys
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

# In GGML type id order (the test checks it).
FORMATS = [
    T.F16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.BF16, T.MXFP4,
]
QUANTIZABLE = {T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4}
# Byte offsets of each block's f16 scales (d, dmin) in ggml's structs.
SCALES = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.MXFP4: [],
}
COLS = 512  # two K-quant super-blocks, sixteen legacy blocks


def sane_halves(rng, n):
    """f16 values of either sign, magnitudes 2^-9 .. 2^-2 (scales)."""
    mag = np.exp2(rng.uniform(-9, -2, n))
    sign = np.where(rng.integers(0, 2, n) == 1, -1.0, 1.0)
    return (sign * mag).astype(np.float16)


def random_blocks(rng, qtype, cols):
    block, size = GGML_QUANT_SIZES[qtype]
    n = cols // block
    data = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at in SCALES[qtype]:
        data[:, at:at + 2] = sane_halves(rng, n).view(np.uint8).reshape(n, 2)
    return data.reshape(-1)


def mxfp4_rows(rng):
    """Random MXFP4 blocks over every exponent byte 0..252 in random order,
    the rest of 16 rows of 16 blocks at 2^-1 (byte 127)."""
    e = np.concatenate([np.arange(253), np.full(16 * 16 - 253, 127)]).astype(np.uint8)
    data = rng.integers(0, 256, (256, 17), dtype=np.uint8)
    data[:, 0] = rng.permutation(e)
    return list(data.reshape(16, -1))


def rows_of(rng, qtype):
    """Byte rows of `qtype`, each COLS values."""
    rows = []
    if qtype in QUANTIZABLE:
        # Values of three magnitudes, and a row with a constant block and
        # zeros (edge cases of the quantizers' scale choice).
        for scale in (0.02, 1.0, 30.0):
            x = (rng.standard_normal(COLS) * scale).astype(np.float32)
            rows.append(as_bytes(gguf.quants.quantize(x.reshape(1, -1), qtype)))
        x = np.zeros(COLS, dtype=np.float32)
        x[32:64] = 0.75
        x[64:96] = rng.standard_normal(32).astype(np.float32)
        rows.append(as_bytes(gguf.quants.quantize(x.reshape(1, -1), qtype)))
    if qtype == T.MXFP4:
        rows.extend(mxfp4_rows(rng))
    elif qtype not in (T.F16, T.BF16):
        for _ in range(1 if qtype in QUANTIZABLE else 3):
            rows.append(random_blocks(rng, qtype, COLS))
    return np.stack(rows)


def as_bytes(q):
    """A quantized row as its bytes (F16 comes back as float16 values)."""
    return np.ascontiguousarray(q).view(np.uint8).reshape(-1)


def main():
    root = Path(__file__).resolve().parents[2]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=root / "kernels/tests/data/gguf_quants.bin")
    args = ap.parse_args()
    rng = np.random.default_rng(20240611)
    out = bytearray(b"KVQF" + struct.pack("<II", 1, len(FORMATS)))
    for qtype in FORMATS:
        data = rows_of(rng, qtype)
        values = gguf.quants.dequantize(data, qtype).astype(np.float32, copy=False)
        rows = data.shape[0]
        assert values.shape == (rows, COLS), (qtype.name, values.shape)
        assert np.isfinite(values).all(), qtype.name
        out += struct.pack("<IIII", int(qtype), rows, COLS, data.size)
        out += data.tobytes()
        out += values.astype("<f4").tobytes()
        print(f"{qtype.name:5} {rows} rows x {COLS}: {data.size} bytes", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(bytes(out))
    print(f"wrote {args.out} ({len(out)} bytes), gguf {gguf_version()}", file=sys.stderr)


def gguf_version():
    from importlib.metadata import version
    return version("gguf")


if __name__ == "__main__":
    main()
