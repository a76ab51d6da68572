# Sourced by the benchmark drivers that run a list of jobs over the machine's GPUs
# (latency_table.sh, speculative_overhead_all.sh).
# deal_over_gpus FUNC ITEM...: the GPUs nvidia-smi lists get the items in turn (item j to GPU
# j mod #GPUs); each GPU runs `FUNC GPU ITEM...` with its items, the GPUs side by side in the
# background; returns once every GPU's run has ended. No GPU listed: exits the script with 1.
deal_over_gpus() {
  local fn=$1 gpus i j mine
  shift
  local items=("$@")
  mapfile -t gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader)
  [ ${#gpus[@]} -gt 0 ] || { echo "$0: no GPU (nvidia-smi lists none)" >&2; exit 1; }
  for i in "${!gpus[@]}"; do
    mine=()
    for j in "${!items[@]}"; do [ $(( j % ${#gpus[@]} )) -eq "$i" ] && mine+=("${items[$j]}"); done
    [ ${#mine[@]} -gt 0 ] && "$fn" "${gpus[$i]}" "${mine[@]}" &
  done
  wait
}
