# Sourced by the one-call GPU scripts (gpu_check.sh, gpu_check_step.sh, gpu_fp8.sh,
# bench_gpu.sh): the carried wheels, the Python path, `versions`, which records what ran,
# and `run`, which gives each measurement its own time limit inside a running budget.
# Needs OUT, BUDGET and start (date +%s) set by the caller.

# Wheels the GPU image lacks (grain, array-record, portpicker, jax-triton), from .whl/ if
# present; flax and jax are the image's own. kernels/ is reached as ultrajax.kernels
# through a link, as pip's package mapping would.
if compgen -G ".whl/*.whl" >/dev/null; then
  rm -rf /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
[ -e ultrajax/kernels ] || ln -s ../kernels ultrajax/kernels

run() {  # run NAME LIMIT_S COMMAND...: at most LIMIT_S, never past the budget
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - ($(date +%s) - start)))
  local t=$((limit < left ? limit : left))
  if [ "$t" -lt 20 ]; then
    echo "== $name: skipped, $left s of the budget left" | tee "$OUT/$name.txt"
    return
  fi
  echo "== $name (limit $t s)"
  timeout "$t" "$@" >"$OUT/$name.txt" 2>&1
  echo "   exit $? after $(($(date +%s) - start)) s"
  grep -E "^\| |ms/step|Error|error" "$OUT/$name.txt" | tail -4
}

versions() {  # what ran: OUT/versions.txt (date, GPU, driver, library versions, commit)
  {
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 - <<'PY'
import importlib
for name in ("jax", "flax", "optax", "triton"):
    try:
        print(name, importlib.import_module(name).__version__, end="  ")
    except ImportError:
        print(name, "absent", end="  ")
print()
PY
    git log -1 --format='commit %h %s' 2>/dev/null || true
  } 2>&1 | tee "$OUT/versions.txt"
}
