#!/usr/bin/env python3
"""Static cost of gemv_mma_kernel's k loop (src/backend/cuda/gemv_mma_kernel.cuh), no GPU needed.

For every gemv_mma_kernel<F, XT, NT, WR, WK> instance in one or two cubins: the SASS instructions of
its innermost loop holding HMMA (the k loop: one prefetch round, prefetch_quads<NT>() quads of 4
weight groups: 8 groups at 4+ n tiles, else 4) per weight group, those that are not HMMA, and the local-memory
(spill) accesses in it. Two cubins (before, after) print side by side.

Build a cubin of one format's instances with the flags of build/compile_commands.json, e.g.
  nvcc -DGEMMA4_HAS_CUDA=1 -Isrc -O3 -DNDEBUG -arch=sm_90a --expt-relaxed-constexpr -std=c++20 \\
       -Xptxas -v -cubin src/backend/cuda/gemv_mma_w4g32.cu -o w4g32.cubin
(-Xptxas -v prints registers and spills per instance). cuobjdump: $CUOBJDUMP, else on PATH (the
CUDA toolkit's, or PyPI's nvidia-cuda-cuobjdump).
Usage: bench/gemv_mma_sass.py [BEFORE.cubin] AFTER.cubin
"""
import collections
import os
import re
import subprocess
import sys

INSTANCE = re.compile(r'PackedFormatE(\d)ELNS0_7ActTypeE(\d)ELi(\d)ELi(\d)ELi(\d)')
INSTRUCTION = re.compile(r'/\*([0-9a-f]{4,})\*/\s+(.*?);')
BRANCH = re.compile(r'\bBRA\b.*?(0x[0-9a-f]+)')


def opcode(text):
    return re.sub(r'^@!?U?P\w+\s+', '', text).split()[0].split('.')[0]


def k_loops(cubin):
    cuobjdump = os.environ.get('CUOBJDUMP', 'cuobjdump')
    sass = subprocess.run([cuobjdump, '-sass', cubin], capture_output=True, text=True,
                          check=True).stdout
    loops = {}
    for function in re.split(r'\n\s+Function : ', sass)[1:]:
        name = INSTANCE.search(function.split('\n', 1)[0])
        if not name:
            continue
        groups = 8 if int(name.group(3)) >= 4 else 4
        code = [(int(a, 16), text.strip()) for a, text in INSTRUCTION.findall(function)]
        at = {address: i for i, (address, _) in enumerate(code)}
        innermost = None
        for i, (address, text) in enumerate(code):
            branch = BRANCH.search(text)
            if not branch:
                continue
            target = int(branch.group(1), 16)
            if target > address or target not in at:
                continue  # forward branch
            ops = collections.Counter(opcode(t) for _, t in code[at[target]:i + 1])
            if ops['HMMA'] and (innermost is None or sum(ops.values()) < sum(innermost.values())):
                innermost = ops
        total = sum(innermost.values())
        loops['<%s>' % ','.join(name.groups())] = (
            total / groups, (total - innermost['HMMA']) / groups, innermost['HMMA'] / groups,
            innermost['LDL'] + innermost['STL'])
    return loops


def main():
    tables = [k_loops(path) for path in sys.argv[1:3]]
    print('instance <F,XT,NT,WR,WK>: SASS per weight group all / non-HMMA / HMMA; LDL+STL in loop')
    for name in sorted(tables[-1]):
        cells = ['%6.1f / %6.1f / %3.0f  spill %d' % t[name] for t in tables if name in t]
        print('%-14s %s' % (name, '  ->  '.join(cells)))


if __name__ == '__main__':
    main()
