"""Test-only: tests/gpu_check.py's parts with the CPU as their device (test_gpu_check.py's
test_parts_run_on_the_cpu_without_pytest), the tiny Qwen2.5-VL in place of the 3B.

    python tests/cpu_parts.py ROOT WORK MEMORY_JSON"""

import sys
from pathlib import Path

root, work, memory = (Path(a) for a in sys.argv[1:4])
sys.path[:0] = [str(root / "tests"), str(root)]
import gpu_check  # the project's folders first

gpu_check.DEVICE, gpu_check.MEMORY_JSON = "cpu", memory
gpu_check.part_environment(work)
parts = ("processor", "rl_core", "generation", "step")
figures = {n: gpu_check.Figures(work / "parts" / f"cpu_{n}.json") for n in parts}
gpu_check.part_processor(work, figures["processor"])
gpu_check.part_rl_core(work, figures["rl_core"])
gpu_check.part_generation(work, figures["generation"], model="qwen_tiny", new_tokens=4, rows=(2, 3))
gpu_check.keep_policies()
gpu_check.part_step("orapo", work, figures["step"], model="qwen_tiny", new_tokens=6)
