# Run 14 call 5: the persistent MLP kernel probe (branch mlp-persistent at f7b8d0d, shipped as a
# plain copy in _probe_mlp/: the device's .git is stale), Ouro-1.4B shapes, M = 1, 8, 32.
set -u
cd _probe_mlp && OUT=$OUT bash bench/gpu_run.sh mlp_persistent:170
