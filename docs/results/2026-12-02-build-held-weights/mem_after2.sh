#!/usr/bin/env bash
# fbf85a0's runs, as run: the 1B ones first; the 3B ones again after the sampler's zombie-child fix (a first 3B run
# lost its samples to a sampler that died on a zombie child, and was dropped); the 3B runs beside a CI run.
cd /work/main
M=/work/notes/s64/mem
run() { local name=$1; shift; .venv/bin/python scripts/build_memory.py --checkpoints /work/notes/s64/ckpt --stop-above-mb 20000 --out $M/$name.json "$@" > $M/$name.log 2>&1; }
run 1b-int4-after2 --shape llama-1b --weights int4
run 1b-gguf-int4-after2 --shape llama-1b --weights int4 --gguf
run 3b-int4-after2 --shape llama-3b --weights int4
run 3b-gguf-int4-after2 --shape llama-3b --weights int4 --gguf
