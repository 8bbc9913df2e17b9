"""Where the shared-chunk kernel's time goes: its saved engine steps replayed through copies of the
kernel with one part of a key tile's work taken out (issue 14).

The shared-chunk kernel moves ~1.8 TB/s on an H200 on every saved step (docs/data/steps/), under
half of the device's copy bandwidth. Each ablation rewrites the module's source
(lazyrt/kernels/triton_shared_chunk.py) with a few text substitutions, imports the copy from a
temporary file and times it on the same call (step_replay.device_us: profiler kernel time, L2
flushed). The ablated kernels give wrong outputs: only their time is read. What each takes out:

- `no key rotation`: the key tile goes to the dots as loaded (no cos/sin loads, no rotation math);
- `no exp`: the scores go into the values' dot without exp2 (the max / sum bookkeeping stays);
- `rows R`: the item's query rows cut to R (the dots and the softmax R rows tall; keys unchanged);
- `no PV dot`: the value tile added to the accumulator instead of multiplied by the weights (its
  two reductions cost more than the dot they replace: slower everywhere, so no evidence either way);
- `loads only`: each key tile's K and V loaded and summed into the accumulator, nothing else: the
  kernel's memory traffic in its access pattern (page gathers, a head's 256 B a token); on the
  smaller saved steps slower than the whole kernel, so not a floor;

    python benchmarks/experiments/shared_kernel_ablation.py [--load docs/data/steps/*.npz]
        [--settings 2:0 1:128 ...] [--variants "as is" "no key rotation"]

GPU only.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import itertools
import os
import sys
import tempfile

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from benchmarks.experiments.step_replay import device_us, load_step, saved_steps, step_config  # noqa: E402
from lazyrt.kernels import triton_shared_chunk as tsc  # noqa: E402

_ROT = ("    k1r = (k1 * cj - k2 * sj).to(dt)\n    k2r = (k2 * cj + k1 * sj).to(dt)\n",
        "    k1r = k1.to(dt)\n    k2r = k2.to(dt)\n")
_EXP = ("    p = tl.exp2(s - m_safe[:, None])\n", "    p = s - m_safe[:, None]\n")
_PV = ("    acc = tl.dot(p.to(dt), v, acc * alpha[:, None], input_precision=DOT_PREC)\n",
       "    acc = acc * alpha[:, None] + tl.sum(p, axis=1)[:, None]"
       " + tl.sum(v.to(tl.float32), axis=0)[None, :]\n")


def _rows(r: int) -> tuple[str, str]:
    return ("    rows = max(MIN_DOT, _pow2(block_pairs * group))\n", f"    rows = {r}\n")


# The memory-only key tile: K (both halves) and V loaded and reduced into acc, nothing else.
_LOADS_ONLY_BODY = '''
    dt = kv_ptr.dtype.element_ty
    j = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    j_ok = j < n
    page = tl.load(chunk_kv_indices_ptr + e_lo + j // PAGE_SIZE, mask=j_ok, other=0)
    dh = tl.arange(0, HEAD_P)
    k_off = page.to(tl.int64) * stride_kp + (j % PAGE_SIZE) * stride_ks + kvh * stride_kh
    k = _tile_load(kv_ptr + k_off[:, None] + dh[None, :], j_ok, dh < HEAD, FULL and HEAD == HEAD_P)
    whole = FULL and HEAD == HEAD_P
    v = _tile_load(kv_ptr + (k_off + stride_kkv)[:, None] + dh[None, :], j_ok, dh < HEAD, whole)
    acc = acc + tl.sum(k.to(tl.float32) + v.to(tl.float32), axis=0)[None, :]
    return m_i, l_i + 1.0, acc  # l_i > 0: the output (so the loads) stays live
'''


def loads_only(src: str) -> str:
    """The module with _key_tile's body (after its docstring) replaced by _LOADS_ONLY_BODY."""
    start = src.index("def _key_tile(")
    doc_end = src.index('"""', src.index('"""', start) + 3) + 3
    end = src.index("\n\n\n@triton.jit", doc_end)
    return src[:doc_end] + _LOADS_ONLY_BODY.rstrip() + src[end:]


def variant(src: str, subs: list[tuple[str, str]], name: str, tmp: str):
    for old, new in subs:
        if old not in src:
            raise SystemExit(f"{name}: the kernel source no longer has {old.strip()!r}")
        src = src.replace(old, new)
    path = os.path.join(tmp, f"tsc_{len(os.listdir(tmp))}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", nargs="*", default=saved_steps())
    p.add_argument("--model", default="llama-3.1-8b", help="config of steps with none beside them")
    p.add_argument("--settings", nargs="*", default=[], metavar="STAGES:MAXNREG",
                   help="also time each variant at these launch settings (maxnreg 0: no cap), "
                        "to see whether what a variant frees in registers buys more programs an SM")
    p.add_argument("--variants", nargs="*", default=None, help="only these variants (names as in the table)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("shared_kernel_ablation.py needs CUDA")
    src = inspect.getsource(tsc)
    tmp = tempfile.mkdtemp()
    variants = [("as is", []), ("no key rotation", [_ROT]), ("no exp", [_EXP]), ("no PV dot", [_PV]),
                ("rows 32", [_rows(32)]), ("rows 16", [_rows(16)]),
                ("no rotation, rows 32", [_ROT, _rows(32)])]  # fmt: skip
    mods = [(name, variant(src, subs, name, tmp)) for name, subs in variants]
    mods.append(("loads only", variant(loads_only(src), [], "loads only", tmp)))
    if args.variants is not None:
        mods = [(n, m) for n, m in mods if n in args.variants]
    settings = [None] + [tuple(int(x) for x in st.split(":")) for st in args.settings]
    table = []
    for path in args.load:
        q, kv, pos, sh, rope, scale, kw = load_step(path, step_config(path, args.model), torch.device("cuda"))
        b = int(path.rsplit("_b", 1)[1].split(".")[0])
        keys = int(sh.chunk_len.sum())
        gb = keys * kv.shape[3] * kv.shape[4] * 2 * kv.element_size() / 1e9
        row = [f"{os.path.basename(path)}", f"{kv.shape[3]}", f"{b}"]
        for (name, mod), st in itertools.product(mods, settings):
            call = (q, kv, pos, sh, rope, scale)
            over = dict(kw, **({"num_stages": st[0], "maxnreg": st[1]} if st else {}))
            fn = lambda m=mod, c=call, k=over: m.shared_chunk_attention_triton(*c, **k)  # noqa: E731
            fn()
            us = device_us(fn, q.device)
            row.append(f"{us:.1f} ({gb / us * 1e3:.2f})")
            at = f" at {st[0]}:{st[1]}" if st else ""
            print(f"{path} {name}{at}: {us:.1f} us", flush=True)
        table.append(row)
    print(f"\n{torch.cuda.get_device_name()}; us a layer (TB/s of distinct K+V)")
    cols = [n + (f" at {st[0]}:{st[1]}" if st else "") for (n, _), st in itertools.product(mods, settings)]
    print("| step | kv heads | batch | " + " | ".join(cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for row in table:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
