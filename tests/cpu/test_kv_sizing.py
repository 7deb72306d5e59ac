"""KV pools sized from the memory free after the weights (`models.memory.sizing`), where kv_cache_tokens is not set:
a GPU's by the numbers CUDA would report (given here), this machine's RAM as it is."""

from __future__ import annotations

import pytest
import torch

from specserve.models.memory.sizing import CPU_CAP_BYTES, bytes_per_position, free_memory, kv_positions
from specserve.workers.actors import _kv_size
from tests.conftest import tiny_llama

GIB = 1 << 30


def test_a_gpu_gives_its_fraction_less_what_is_in_use():
    cuda = torch.device("cuda", 0)
    per = 131072  # a 7B in bf16: 32 layers x 8 kv heads x 128 x 2 x 2 bytes
    # 80 GiB, 15 GiB in use after the weights: 0.9 x 80 - 15 = 57 GiB
    positions, how = kv_positions(per, cuda, memory=(65 * GIB, 80 * GIB))
    assert positions == 57 * GIB // per // 256 * 256 and "0.9 of the GPU's 80.0 GiB less 15.0 GiB in use" in how
    # a lower fraction, and a draft still to load set aside
    positions, how = kv_positions(per, cuda, 0.5, reserve=2 * GIB, memory=(65 * GIB, 80 * GIB))
    assert positions == 23 * GIB // per // 256 * 256 and "2.0 GiB set aside for the draft" in how
    with pytest.raises(ValueError, match="kv_cache_tokens"):  # nothing left: say how to go on
        kv_positions(per, cuda, 0.15, memory=(65 * GIB, 80 * GIB))


def test_a_cpu_gives_a_share_of_available_ram_capped():
    cpu = torch.device("cpu")
    assert kv_positions(1000, cpu, memory=(8 * GIB, 16 * GIB))[0] == 2 * GIB // 1000 // 256 * 256
    assert kv_positions(1000, cpu, memory=(200 * GIB, 256 * GIB))[0] == CPU_CAP_BYTES // 1000 // 256 * 256
    # no more than can be used: the positions of 64 sessions of the whole context
    positions, how = kv_positions(1000, cpu, memory=(8 * GIB, 16 * GIB), most=64 * 2048)
    assert positions == 64 * 2048 and "64 sessions of the model's whole context" in how
    free, total = free_memory(cpu)  # this machine's own
    assert 0 < free <= total


def test_a_target_and_its_colocated_draft_are_sized_together(tmp_path, monkeypatch):
    from specserve.models.memory import sizing

    monkeypatch.setattr(sizing, "free_memory", lambda device: (4 * GIB, 8 * GIB))
    target = tiny_llama(0, vocab=64, layers=2, hidden=32, scale=8, dtype=torch.float32)
    draft = tiny_llama(1, vocab=64, layers=1, hidden=32, scale=8, dtype=torch.float32)
    draft.save_pretrained(str(tmp_path / "draft"))
    per_t, per_d = bytes_per_position(target.config, torch.float32), bytes_per_position(draft.config, torch.float32)
    assert per_t == 2 * 2 * target.config.num_key_value_heads * (32 // target.config.num_attention_heads) * 4
    budget = 0.0002 * 4 * GIB  # below 64 sessions of its whole context
    assert _kv_size(target, None, 0.0002)[0] == int(budget // per_t) // 256 * 256
    together, how = _kv_size(target, str(tmp_path / "draft"), 0.0002)
    reserve = (tmp_path / "draft" / "model.safetensors").stat().st_size
    assert together == int((budget - reserve) // (per_t + per_d)) // 256 * 256
    assert "set aside for the draft" in how and "available RAM" in how
