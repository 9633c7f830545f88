"""Run one trainer and record how much this process's peak RSS grew while it trained (a test helper).

    PEAK_MEMORY_DIR=out torchrun --nproc_per_node 4 tests/peak_memory.py 04_tensor_parallel.train --tp 4 ...

The baseline is taken when the trainer's `run` starts: Python, torch, the data and the process group are
already there, so the growth is what the run itself held (parameters, gradients, optimizer states,
activations, communication buffers) at its peak. Writes $PEAK_MEMORY_DIR/MODULE.rank<r>.json: "growth",
"built" (the growth once the rank's parameters exist, before any step) and "parameters" (bytes).
"""
import json
import os
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024


def main(module, argv):
    trainer, loop = import_module(module), import_module("loop")
    seen = {}
    inner_run, inner_train = trainer.run, loop.train

    def run(*args, **kwargs):
        import torch
        torch.empty(1024, 1024).normal_() @ torch.empty(1024, 1024).normal_()   # first use: thread pools,
        with torch.device("meta"):                 # and the meta device's lazily imported kernels (~130 MB)
            import model as modeling
            modeling.LlamaForCausalLM(modeling.LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8,
                                                           num_hidden_layers=1, num_attention_heads=1,
                                                           num_key_value_heads=1))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                                    # reset the peak (VmHWM) to the current RSS
        seen["base"] = _status("VmRSS")
        return inner_run(*args, **kwargs)

    def train(args, step, model, optimizer, *rest, **kwargs):   # the parameters exist: measure the build
        seen["built"] = _status("VmHWM") - seen["base"]
        tensors = [*model.parameters(), *(p for group in optimizer.param_groups for p in group["params"])]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        seen["parameters"] = sum(storages.values())              # distinct storages: ZeRO-3's are its shards
        return inner_train(args, step, model, optimizer, *rest, **kwargs)

    trainer.run, loop.train = run, train
    trainer.main(argv)
    rank = int(os.environ.get("RANK", 0))
    result = dict(rank=rank, growth=_status("VmHWM") - seen["base"], built=seen["built"],
                  parameters=seen["parameters"])
    Path(os.environ["PEAK_MEMORY_DIR"], f"{module}.rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
