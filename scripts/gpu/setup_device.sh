# Sourced at the start of every command on the lent GPU machine (Python 3.12, torch and triton
# preinstalled, no megatron-core): installs the carried wheels (README "Running on GPUs") of the folder WHEELS (default .whl)
# into /tmp/site (another folder .whlX: /tmp/siteX, e.g. WHEELS=.whl019 for megatron-core 0.19.2) and keeps NVLink
# multicast off as the machine requires.
WHEELS=${WHEELS:-.whl}
SITE=/tmp/site${WHEELS#.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE $WHEELS/*.whl || return 1
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 - <<'PY'
import torch, triton, megatron.core
print("torch", torch.__version__, "triton", triton.__version__, "megatron-core", megatron.core.__version__,
      "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))
PY
# Results go to $RES and come back as one archive ($OUT takes at most 8 files), even on a time-out.
export RES=/tmp/res; mkdir -p $RES
trap 'tar czf $OUT/results.tgz -C $RES . 2>/dev/null' EXIT
