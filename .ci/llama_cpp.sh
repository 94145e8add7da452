#!/usr/bin/env bash
# Build llama.cpp's `llama-simple` (CPU only) into $1, once: the format's reference implementation, which the
# GGUF tests load the tiny GLM-5 files with (tests/gguf/test_llama_cpp.py). Its source is the llama.cpp that
# llama-cpp-python 0.3.36 vendors (it knows the glm-dsa architecture); ~3 min on 2 cores, then cached.
set -euo pipefail
dest=$1
version=0.3.36
[ -x "$dest/bin/llama-simple" ] && exit 0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work" >/dev/null 2>&1 \
  || pip download -q --no-deps "llama-cpp-python==$version" -d "$work"
tar xzf "$work"/llama_cpp_python-$version.tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DGGML_OPENMP=OFF >/dev/null
ninja -C "$work/build" llama-simple >/dev/null
mkdir -p "$dest/bin"
cp -a "$work/build/bin/"lib*.so* "$dest/bin/"   # beside the binary: the test puts that folder on LD_LIBRARY_PATH
cp "$work/build/bin/llama-simple" "$dest/bin/"
