"""Run by `accelerate launch` (2 processes over gloo) from test_ulysses_sp.py: does DeepSpeed's Ulysses sequence
parallelism (ALST's `UlyssesSPAttentionHF`, registered as transformers' "sdpa" attention the way ALST does) run on
CPU, and is it exact? Each process writes `--out/rank<i>.json`.

Both processes first run the unsharded tiny Qwen2 on the whole batch (the reference: per-token log-probs and the
gradient of a weighted token sum). Then Ulysses is registered, each process feeds the same batch's positions
[rank*S/2, (rank+1)*S/2) with their global position_ids, scores its half of the tokens (the labels are shifted
BEFORE sharding, so the last position of the first half is scored against the first token of the second half, as
ALST's UlyssesSPDataLoaderAdapter does), and the per-token log-probs are gathered across the group; the gradient of
the group's token sum is each process's local sum backpropagated, then summed over the group.

Then GRPO's layout (grpo_trainer/modeling/sequence_parallel.py) over the same engine: a left-padded micro-batch
left-aligned, sliced, scored and gathered back against the padded, masked forward, and the trainer's scoring call
(`sharded_scores`) the same way; docs/DISTRIBUTED.md, "Sequence parallelism (DeepSpeed Ulysses)".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as torch_dist
from accelerate import Accelerator
from deepspeed_cpu import skip_shm_op_build  # beside this script, on sys.path when it is launched
from teardown import leave_cleanly

from grpo_trainer.modeling import logprobs
from grpo_trainer.modeling.forwards import ForwardSettings
from grpo_trainer.modeling.logprobs import completion_logprobs
from grpo_trainer.modeling.sequence_parallel import SequenceShard, deactivate, gather_positions, install, sharded_scores

B, S, VOCAB = 2, 12, 97  # B sequences of S positions; S/2 per process


def _model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # 4 query heads and 2 KV heads: both divisible by the 2-process group (Ulysses splits heads across it).
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa", torch_dtype=torch.float32)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).float()


def _token_logps(model, ids, positions, labels, mask=None):
    """[b, s] log-probs of `labels` (-100: none, scored 0) from a forward of `ids` at `positions`."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                   use_cache=False).logits.float()  # [b, s, V]
    logps = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return logps * (labels != -100)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    skip_shm_op_build()
    accelerator = Accelerator()
    rank, world = accelerator.process_index, accelerator.num_processes
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    deepspeed.init_distributed(dist_backend="gloo")  # wraps the process group accelerate started

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, S), generator=generator)  # [B, S], the same on both processes
    weights = torch.rand(B, S, generator=generator)  # per-token loss weights (a stand-in for advantages)
    positions = torch.arange(S).expand(B, S)
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)  # [B, S]: next token, none after the last

    # Padding, as GRPO lays rows out: row 0 has 3 left pads before its 9 real tokens (GRPO left-pads prompts).
    # The same tokens left-aligned put the 3 pads at the end, where causal attention never lets a real token see
    # them; so a mask-free forward (what Ulysses does) is exact for the real tokens only in that layout.
    padded = {"ids": ids.clone(), "mask": torch.ones(B, S, dtype=torch.long)}
    padded["ids"][0, :3], padded["mask"][0, :3] = 0, 0
    padded["positions"] = (padded["mask"].cumsum(-1) - 1).clamp(min=0)
    aligned = {"ids": torch.cat([padded["ids"][:1, 3:], padded["ids"][:1, :3]], 1), "mask": padded["mask"].flip(1)}
    aligned = {"ids": torch.cat([aligned["ids"], ids[1:]]), "mask": aligned["mask"], "positions": positions}
    for layout in (padded, aligned):  # next token where both it and the position scored are real
        real = layout["mask"].bool()
        layout["labels"] = torch.cat([layout["ids"][:, 1:], torch.zeros(B, 1, dtype=torch.long)], 1).masked_fill(
            ~(real & torch.cat([real[:, 1:], torch.zeros(B, 1, dtype=torch.bool)], 1)), -100)

    model = _model()
    # GRPO's layout (grpo_trainer/modeling/sequence_parallel.py): the left-padded row 0 and row 1 cut to 11 columns
    # (5 prompt + 6 completion; the width pads to 12 for the group of 2), the padded forward's masked completion
    # log-probs and the gradient of a weighted sum of them are the reference.
    grpo_ids, grpo_mask = padded["ids"][:, :11], padded["mask"][:, :11]  # [B, 11]
    grpo_weights = torch.rand(B, 6, generator=generator)  # [B, T]: a stand-in for advantages
    reference_grpo = completion_logprobs(model, grpo_ids, grpo_mask, completion_length=6).logps  # [B, T]
    (reference_grpo * grpo_weights).sum().backward()
    reference_grpo_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with torch.no_grad():  # the masked, unsharded reference of the real tokens, in row order
        padded_reference = _token_logps(model, padded["ids"], padded["positions"], padded["labels"],
                                        padded["mask"])[padded["mask"].bool()]
    reference_logps = _token_logps(model, ids, positions, labels)
    (reference_logps * weights).sum().backward()
    reference_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    local = slice(rank * S // world, (rank + 1) * S // world)
    with torch.no_grad():  # the control: this process's half alone, without the exchange, lacks the other half
        alone = _token_logps(model, ids[:, local], positions[:, local], labels[:, local])
    alone_diff = (alone - reference_logps[:, local]).abs().max().item()

    # The trainer's scoring call (sharded_scores): Ulysses installed only around the forward, over the
    # whole world group, for the 2-row micro-batch and then a 1-row one (row counts vary between micro-batches);
    # then the 2-row one again through the LM head in chunks of 5 positions (3 chunks of this process's 12), and
    # with rank 1's head check failing (`scoring_head` None there), where the group must agree on scoring the
    # model's own logits (a second forward on both processes, or they would wait on each other).
    scorer = {}
    install(model)
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    # And with the sequence-tiled MLP, 4 of the process's 6 positions at a time (2 tiles), under gradient
    # checkpointing (the trainer's default), where the tiled MLP is recomputed inside the layer's recomputation.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tile_calls = []
    for layer in model.model.layers:
        layer.mlp.down_proj.register_forward_hook(lambda module, args, output: tile_calls.append(args[0].shape[-2]))
    for case, rows, chunk, head_fails, tile in (("two_rows", slice(0, 2), 1024, False, 0),
                                                ("one_row", slice(1, 2), 1024, False, 0),
                                                ("chunked", slice(0, 2), 5, False, 0),
                                                ("own_logits", slice(0, 2), 1024, rank == 1, 0),
                                                ("tiled", slice(0, 2), 1024, False, 4)):
        model.zero_grad(set_to_none=True)
        forwards.clear()
        original = logprobs.scoring_head
        if head_fails:
            logprobs.scoring_head = lambda *args: None
        try:
            tile_calls.clear()
            options = ForwardSettings(padding_free=False, chunk_size=chunk, mlp_tile_tokens=tile)
            scored = sharded_scores(model, grpo_ids[rows], grpo_mask[rows], 6, torch_dist.group.WORLD,
                                    options).logps
        finally:
            logprobs.scoring_head = original
        (scored * grpo_weights[rows]).sum().backward()
        deactivate()
        for parameter in model.parameters():
            torch_dist.all_reduce(parameter.grad)
        if rows.start == 0:
            scorer[case] = {"logp_diff": (scored - reference_grpo).abs().max().item(),
                            "grad_diff": max((p.grad - reference_grpo_grads[n]).abs().max().item()
                                             for n, p in model.named_parameters()),
                            "forwards": len(forwards), "mlp_rows": sorted(set(tile_calls))}
        else:
            with torch.no_grad():
                plain_row = completion_logprobs(model, grpo_ids[rows], grpo_mask[rows], completion_length=6).logps
            scorer[case] = {"logp_diff": (scored - plain_row).abs().max().item()}
    model.zero_grad(set_to_none=True)

    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=world,
        micro_batch_size=B, seq_length_is_variable=True)
    group = mpu.get_sequence_parallel_group()
    logps = _token_logps(model, ids[:, local], positions[:, local], labels[:, local])  # [B, S/2]
    (logps * weights[:, local]).sum().backward()
    for parameter in model.parameters():  # the group's loss is the sum of its processes' token sums
        torch_dist.all_reduce(parameter.grad, group=group)
    pieces = [torch.empty_like(logps) for _ in range(world)]
    torch_dist.all_gather(pieces, logps.detach().contiguous(), group=group)
    sharded_logps = torch.cat(pieces, dim=1)  # [B, S]
    layout_diffs = {}
    for name, layout in (("left_padded", padded), ("left_aligned", aligned)):
        with torch.no_grad():
            half = _token_logps(model, *(layout[k][:, local] for k in ("ids", "positions", "labels", "mask")))
        torch_dist.all_gather(pieces, half.contiguous(), group=group)
        real_logps = torch.cat(pieces, dim=1)[layout["mask"].bool()]  # real tokens in row order, like the reference
        layout_diffs[name] = (real_logps - padded_reference).abs().max().item()

    grad_diff = max((p.grad - reference_grads[n]).abs().max().item() for n, p in model.named_parameters())
    grad_scale = max(g.abs().max().item() for g in reference_grads.values())
    grads_nonzero = all(bool(p.grad.abs().sum() > 0) for p in model.parameters())
    # The same under Ulysses, through SequenceShard: rows left-aligned, this process's slice scored without a mask,
    # the slices gathered (differentiably) and the completion tokens picked; every process computes the same loss
    # from the gathered log-probs, so the group's gradient is the sum of the processes' gradients.
    model.zero_grad(set_to_none=True)
    shard = SequenceShard.of(grpo_ids, grpo_mask, prompt_width=5, rank=rank, sp_size=world)
    local_logps = _token_logps(model, shard.input_ids, shard.position_ids, shard.labels)  # [B, W / sp]
    grpo_logps = shard.completion(gather_positions(local_logps, group))  # [B, T]
    (grpo_logps * grpo_weights).sum().backward()
    for parameter in model.parameters():
        torch_dist.all_reduce(parameter.grad, group=group)
    real = grpo_mask[:, 5:].bool()  # the completion tokens a loss reads (all real here)
    grpo_layout = {"width": shard.width, "real_tokens": int(real.sum()),
                   "logp_diff": (grpo_logps - reference_grpo)[real].abs().max().item(),
                   "logp_scale": reference_grpo[real].abs().max().item(),
                   "grad_diff": max((p.grad - reference_grpo_grads[n]).abs().max().item()
                                    for n, p in model.named_parameters()),
                   "grad_scale": max(g.abs().max().item() for g in reference_grpo_grads.values())}

    result = {"num_processes": world, "sp_world_size": mpu.get_sequence_parallel_world_size(),
              "local_positions": S // world, "logp_max_diff": (sharded_logps - reference_logps).abs().max().item(),
              "logp_scale": reference_logps.abs().max().item(), "grad_max_diff": grad_diff, "grad_scale": grad_scale,
              "alone_logp_diff": alone_diff, "padded_logp_diff": layout_diffs,
              "grads_nonzero": grads_nonzero, "grpo_layout": grpo_layout, "scorer": scorer}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    leave_cleanly()


if __name__ == "__main__":
    main()
