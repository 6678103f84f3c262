#!/usr/bin/env bash
# benchmarks/gpu.py on a lent GPU machine (docs/gpu.md), from a bare start: installs the wheels
# carried in .whl/ (webdataset and what the image lacks), builds _core in place for the
# machine's python3, then runs the script with this script's arguments. Everything it prints
# also goes to $OUT (machine.txt, build.txt, log.txt), which comes back even on a timeout.
#     bash benchmarks/gpu_lent.sh --budget-s 240
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
out=${OUT:?OUT must name the folder that comes back}
{ nvidia-smi -L; df -hT . /tmp; nproc; free -g; python3 --version; } >"$out/machine.txt" 2>&1
cat "$out/machine.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
start=$(date +%s)
if ! { cmake -S . -B build/lent -G Ninja -DFLASHSTREAM_BUILD_PYTHON=ON \
         -DPython_EXECUTABLE="$(command -v python3)" && cmake --build build/lent; } \
       >"$out/build.txt" 2>&1; then
  tail -30 "$out/build.txt"
  exit 1
fi
cp build/lent/_core*.so flashstream/
echo "built _core in $(( $(date +%s) - start )) s"
python3 -c "import flashstream, torch; print('flashstream', flashstream.__file__, 'torch',
torch.__version__, 'cuda', torch.cuda.is_available())" || exit 1
python3 benchmarks/gpu.py --out "$out" --workdir "$PWD/gpu-work" "$@" 2>&1 | tee "$out/log.txt"
