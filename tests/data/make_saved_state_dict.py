"""Writes tests/data/state_dict_<commit>.pt: a ZenFlowOptimizer state dict saved mid-window
(host work in flight, a partial window, bf16 and fp32 params) by the code of one commit, with
the model's weights and the params after 6 more steps, for
tests/test_checkpoint.py::test_a_state_dict_saved_by_an_earlier_version_loads.

    PYTHONPATH=<checkout of that commit> python tests/data/make_saved_state_dict.py OUT.pt
"""

import copy
import sys

import torch

from tests.support.helpers import batches, make_model, param_groups, params_of, train
from zenflow_triton import ZenFlowOptimizer

CFG = dict(topk_ratio=0.2, update_interval=4, select_interval=8, min_offload_numel=64)


def main(out: str) -> None:
    data = batches(20)
    model = make_model()
    opt = ZenFlowOptimizer(param_groups(model), **CFG)
    train(model, opt, data[:14])  # step 14: the window of step 12 pending, 2 steps accumulated
    # a deep copy, as torch.save would make: the live tensors move on with the run
    saved = copy.deepcopy({"opt": opt.state_dict(), "model": model.state_dict()})
    train(model, opt, data[14:20])
    opt.synchronize()
    saved["after"] = params_of(model)
    opt.close()
    torch.save(saved, out)


if __name__ == "__main__":
    main(sys.argv[1])
