"""A model's shape from its config alone: counted on the meta device, equal to the real model's counts."""

import time

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Qwen2Config

from grpo_trainer.planning import model_shape, shape_of

CONFIG = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def real_model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIG, dtype=torch.float32)


def test_counts_equal_the_real_models():
    shape, model = model_shape(CONFIG), real_model()
    assert shape.parameters == sum(p.numel() for p in model.parameters())  # the tied head counted once
    layer = model.model.layers[0]
    assert shape.layer_parameters == sum(p.numel() for p in layer.parameters())
    assert shape.linear_parameters == sum(m.weight.numel() for m in model.model.layers.modules()
                                          if isinstance(m, torch.nn.Linear))
    assert shape.largest_parameter == 300 * 64  # the embedding
    assert (shape.vocab, shape.hidden, shape.intermediate, shape.layers, shape.heads, shape.kv_heads,
            shape.head_dim, shape.tied_head) == (300, 64, 160, 3, 4, 2, 16, True)
    assert shape.adapter_parameters == 0 and shape.trainable == shape.parameters
    assert (shape.attention_inputs_kept, shape.mlp_inputs_kept, shape.down_input_kept, shape.norms_trained) \
        == (3, 2, True, True)


@pytest.mark.parametrize(("targets", "dropout"), [(["q_proj", "v_proj"], 0.0), ("all-linear", 0.1)])
def test_an_adapter_is_counted_as_peft_builds_it(targets, dropout):
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM")
    shape = model_shape(CONFIG, config)
    wrapped = get_peft_model(real_model(), config)
    assert shape.adapter_parameters == sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    assert shape.trainable == shape.adapter_parameters and not shape.norms_trained
    if dropout:  # adapted modules keep their dropped copy instead: q/k/v/o/gate/up read 64 features, down 160
        assert shape.dropout_inputs == 6 * 64 + 160 and shape.attention_inputs_kept == 0
    else:  # q and v keep their input for their adapters; k, o and the MLP are frozen
        assert (shape.attention_inputs_kept, shape.output_input_kept, shape.mlp_inputs_kept,
                shape.down_input_kept, shape.dropout_inputs) == (2, False, 0, False, 0)
    assert shape_of(wrapped, CONFIG) == shape  # an already wrapped model gives the same shape


def test_a_7b_config_is_planned_in_a_second_without_memory():
    big = Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                      num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)
    started = time.perf_counter()
    shape = model_shape(big)
    assert time.perf_counter() - started < 5
    assert shape.parameters == 7_615_616_512  # Qwen2.5-7B's published count


def test_a_zero3_launch_does_not_partition_the_meta_model(tmp_path):
    """Under ZeRO-3 transformers builds models inside deepspeed.zero.Init, which cannot copy meta tensors."""
    pytest.importorskip("deepspeed")
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    expected = sum(p.numel() for p in real_model().parameters())
    config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    assert is_deepspeed_zero3_enabled()
    assert model_shape(CONFIG).parameters == expected
    assert is_deepspeed_zero3_enabled()  # restored
    del config
