"""Scripts that need a GPU (run by bench/gpu_check.sh where one is at hand)."""
