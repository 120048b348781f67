"""The vLLM rollout backend (`use_vllm=True`), in TRL 1.16's two modes.

Decisions:

1. Everything that can be refused is refused when the backend is built, before the trainer loads any model: vLLM
   missing or of an unverified version, sleep mode where the platform has none, `generation_kwargs` that are not
   vLLM sampling parameters, a server that does not answer within `vllm_server_timeout`; and by `check_model`, a
   head size vLLM's CPU attention cannot run.
2. `colocate`: each process runs its own engine (`colocate.ColocateEngine`) on its own rows. `server`: every
   process's rows are gathered, the main process sends them to the server, and each process takes its own
   completions back, as in TRL.
3. Weights are pushed before a rollout whenever the optimizer step changed since the last push (`sync_weights`
   with the step as version), so gradient accumulation and the micro-steps of one round push nothing. An engine
   that slept with its weights discarded (sleep mode) gets them again whatever the version.
4. Capabilities: the engine's own log-probs (`engine_logps`, vLLM's processed log-probs: the distribution it sampled
   from, after temperature and filtering), its own weights and images (decision 7); no replay tensors, no stop
   strings (vLLM would need its own detokenised text). Logits processors: only those vLLM's sampling parameters
   express.
5. Engine settings follow TRL: `max_num_seqs` = per_device_train_batch_size x vllm_tensor_parallel_size x
   steps_per_generation; on CPU the KV cache holds that many sequences of the longest expected prompt plus
   `max_completion_length` (and at least one `vllm_max_model_length` sequence).
6. The weight-sync check (`sync_check`) runs on the first rollout sampled after a scheduled push. Where rounds are
   sampled on a producer thread (`async_rollouts`), the check cannot run there (it runs a trainer forward and
   collectives while the optimizer moves the weights): it runs on the main thread right after the scheduled push,
   which happens with no job in flight, on rows of the last round the engine sampled (any tokens probe the weights:
   both sides score them at the weights just pushed).
7. Images, as TRL sends them: each image row goes to vLLM as its prompt with the image placeholders unexpanded
   (`multimodal.unexpanded_ids`) and its images, and the prompt vLLM expands must be the trainer's
   (`sampling.check_engine_prompts`). A family whose expansion cannot be undone falls back to `model.generate`
   for its image rounds (`image_support`, named in the log); a family vLLM cannot load at all is refused when the
   trainer is built (`checks.check_architecture`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch import nn
from transformers import GenerationConfig

from grpo_trainer.modeling.unwrap import causal_lm
from grpo_trainer.rollout.backend import VLLM, Capabilities, MemoryProfile, RolloutBackend, register_backend
from grpo_trainer.rollout.capture import KEEP_NOTHING, Capture
from grpo_trainer.rollout.settings import BackendChoice, VLLMSettings
from grpo_trainer.rollout.types import PromptBatch, Rollout
from grpo_trainer.rollout.vllm import checks, sampling, sync_check

__all__ = ["VLLMBackend"]

logger = logging.getLogger(__name__)

_DEFAULT_PROMPT_TOKENS = 512  # the KV cache's allowance per sequence when max_prompt_length is None (CPU)


def _has_images(prompts: PromptBatch) -> bool:
    return prompts.image_lists is not None and any(prompts.image_lists)


@register_backend(VLLM)
class VLLMBackend(RolloutBackend):
    """Rollouts from vLLM, colocated or on a server (decision 2)."""

    capabilities = Capabilities(logits_processors=False, multi_turn=True, images=True, engine_logps=True,
                                own_weights=True)

    def __init__(self, settings: VLLMSettings) -> None:
        from accelerate import PartialState

        self.settings = settings
        self.version = checks.check_installed()
        self.mode = settings.mode
        sampling.check_generation_kwargs(settings.generation_kwargs)
        self.is_main = PartialState().is_main_process
        self.client = self.engine = self.weights = self.policy = self.processor = None
        self._engine_ids: tuple[PromptBatch, dict[int, list[int]]] | None = None  # decision 7, per prompt batch
        self.loaded: int | None = None
        self.schedule = sync_check.SyncSchedule(settings.sync_check_interval)
        self._check_at_push = False  # decision 6: rounds sampled off the main thread
        self._probe: tuple[PromptBatch, Rollout] | None = None  # the last rollout, for a check at the next push
        if self.mode == "server":
            from grpo_trainer.rollout.vllm.server import ServerClient, server_url

            url = server_url(settings.server_base_url, settings.server_host, settings.server_port)
            failure = None
            if self.is_main:
                try:
                    self.client = ServerClient(url, settings.server_timeout, settings.group_port)
                    self._warn_on_logprobs_mode()
                except (ConnectionError, RuntimeError) as exc:  # every process raises it, none waits forever
                    failure = exc
            device, failure = self._shared((self.client.device if self.client is not None else None, failure))
            if failure is not None:
                raise failure
            self.cpu = device == "cpu"
        else:
            self.cpu = checks.on_cpu()
            checks.check_sleep_mode(settings.enable_sleep_mode, self.cpu)

    @classmethod
    def memory_profile(cls, choice: BackendChoice, device_type: str) -> MemoryProfile:
        """An engine in the process when colocated; nothing here with a server."""
        colocated = choice.vllm is not None and choice.vllm.mode == "colocate"
        return dataclasses.replace(super().memory_profile(choice, device_type),
                                   cache="engine" if colocated else "remote")

    @classmethod
    def from_settings(cls, choice: BackendChoice) -> VLLMBackend:
        if choice.vllm is None:
            raise ValueError("the vLLM backend needs the config's vLLM settings: build the choice with "
                             "grpo_trainer.config.settings.backend_choice(args).")
        return cls(choice.vllm)

    @staticmethod
    def _shared(value: Any) -> Any:
        """The main process's `value` on every process."""
        from accelerate.utils import broadcast_object_list

        box = [value]
        broadcast_object_list(box, from_process=0)
        return box[0]

    def _warn_on_logprobs_mode(self) -> None:
        mode = self.client.logprobs_mode
        if self.settings.importance_sampling_correction and mode not in (None, "processed_logprobs"):
            logger.warning(f"The vLLM server runs with `--logprobs-mode {mode}`, which biases the importance sampling "
                           "correction. Restart it with `--logprobs-mode processed_logprobs`, or set "
                           "`vllm_importance_sampling_correction=False`.")

    def check_model(self, model: str | nn.Module, trust_remote_code: bool = False) -> None:
        if isinstance(model, str):
            from transformers import AutoConfig

            try:
                config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
            except OSError:  # loading the model reports it
                return
        else:
            config = causal_lm(model).config
        if self.mode == "colocate":  # a server loads its own model
            names = [type(causal_lm(model)).__name__] if not isinstance(model, str) else []
            checks.check_architecture(names + list(getattr(config, "architectures", None) or []))
        checks.check_head_dim(config, self.cpu)

    # -------------------------------------------------------------------------------------------- engine

    def start(self, model: nn.Module, processing_class: Any) -> None:
        from grpo_trainer.modeling.export import check_exportable
        from grpo_trainer.rollout.multimodal import image_placeholder, is_processor

        check_exportable(model)
        self.family = getattr(causal_lm(model).config, "model_type", type(causal_lm(model)).__name__)
        if is_processor(processing_class):  # decision 7
            self.processor, self.placeholder = processing_class, image_placeholder(processing_class)
        if self.mode == "server":
            from grpo_trainer.rollout.vllm.server import ServerWeights

            self.weights = ServerWeights(self.client, self._shared(self.client.transfer if self.client else None))
            return
        from accelerate import PartialState

        from grpo_trainer.rollout.vllm.colocate import ColocateEngine, EngineSettings, kv_cache_bytes

        vllm, lm = self.settings, causal_lm(model)
        max_num_seqs = vllm.rows_per_round * vllm.tensor_parallel_size
        longest = vllm.longest_sequence or _DEFAULT_PROMPT_TOKENS + vllm.max_completion_length
        model_length = vllm.max_model_length or getattr(lm.config.get_text_config(), "max_position_embeddings",
                                                        longest)
        dtype = next(p.dtype for p in lm.parameters() if p.is_floating_point())
        settings = EngineSettings(
            tensor_parallel_size=vllm.tensor_parallel_size,
            gpu_memory_utilization=vllm.gpu_memory_utilization, max_model_length=vllm.max_model_length,
            max_num_seqs=max_num_seqs, enable_sleep_mode=vllm.enable_sleep_mode, model_impl=vllm.model_impl,
            trust_remote_code=vllm.trust_remote_code,
            seed=PartialState().process_index // vllm.tensor_parallel_size, cpu=self.cpu,
            kv_cache_bytes=kv_cache_bytes(lm.config, dtype, max(model_length, max_num_seqs * longest)))
        self.engine = ColocateEngine(model, processing_class, settings)

    def sample_off_main_thread(self) -> None:
        """Decision 6: the weight-sync check moves to the main thread, after each scheduled push."""
        self._check_at_push = True

    def sync_weights(self, model: nn.Module, version: int) -> None:
        asleep = self.engine is not None and self.engine.weights_asleep
        if version == self.loaded and not asleep:
            return
        from grpo_trainer.modeling.export import inference_weights

        if self.engine is not None:
            unreached = self.engine.load_weights(inference_weights(model))
        else:
            unreached = self._shared(self.weights.push(model))
        self.loaded, self.policy = version, model
        self.schedule.pushed(unreached)
        if self._check_at_push and self.schedule.due and self._probe is not None:  # decision 6
            self._run_check(model, *self._probe)

    def generate(self, model: nn.Module, prompts: PromptBatch, config: GenerationConfig,
                 capture: Capture = KEEP_NOTHING) -> Rollout:
        if self.engine is None and self.weights is None:
            raise RuntimeError("the vLLM backend was not started: call start(model, tokenizer) and sync_weights() "
                               "first (the trainer does both).")
        settings = sampling.sampling_settings(config, prompts.ids.shape[1], self.settings.generation_kwargs,
                                              self.settings.structured_outputs_regex)
        greedy = settings["temperature"] == 0
        with_images = _has_images(prompts)
        requests = sampling.prompt_runs(prompts, greedy, self.engine_ids(prompts) if with_images else None)
        if self.engine is not None:
            completions, seen = self.engine.generate(requests, settings)
        else:
            completions, seen = self._generate_on_server(requests, settings)
        if with_images:
            sampling.check_engine_prompts(prompts, greedy, seen, self.family)
        out = sampling.to_rollout(prompts, completions, config)
        if self._check_at_push:
            self._probe = (prompts, out)
        elif self.schedule.due:
            self._run_check(model, prompts, out)
        return out

    # ------------------------------------------------------------------------------------------------ images

    def engine_ids(self, prompts: PromptBatch) -> dict[int, list[int]]:
        """Each image row's prompt ids with their image placeholders unexpanded (decision 7), computed once per
        prompt batch; ValueError when the processor's expansion cannot be found in a row."""
        from grpo_trainer.rollout.multimodal import unexpanded_ids

        if self._engine_ids is None or self._engine_ids[0] is not prompts:
            ids: dict[int, list[int]] = {}
            for start, rows in sampling.run_starts(prompts):  # once per run of identical rows, for every row of it
                if prompts.image_lists[start]:
                    unexpanded = unexpanded_ids(self.processor, self.placeholder, sampling.row_ids(prompts, start),
                                                prompts.image_lists[start])
                    ids.update({row: unexpanded for row in range(start, start + rows)})
            self._engine_ids = (prompts, ids)
        return self._engine_ids[1]

    def image_support(self, prompts: PromptBatch) -> str | None:
        """None when vLLM takes these image prompts (decision 7); else why not. On a server, whose generation is a
        collective, every process gets the same answer; colocated, each process decides for its own engine (no
        collective: asynchronous rollouts call this from their producer thread)."""
        reason = None
        if self.processor is None:
            reason = "the prompts hold images but the trainer has no processor"
        else:
            try:
                self.engine_ids(prompts)
            except ValueError as exc:
                reason = str(exc)
        reasons = [reason] if reason is not None else []
        if self.mode == "server":
            from accelerate.utils import gather_object

            reasons = [r for r in gather_object([reason]) if r is not None]
        if not reasons:
            return None
        return (f"vLLM cannot be given this {self.family} model's image prompts ({reasons[0]}); rounds with images "
                "run on model.generate, text-only rounds on vLLM.")

    # ------------------------------------------------------------------------------------- weight-sync check

    def _run_check(self, model: nn.Module, prompts: PromptBatch, out: Rollout) -> None:
        """The check leaves torch's generator as it found it: the engine draws from it when it scores (decision 3 of
        `colocate`), and a check that ran in a resumed run but not at the same point of the straight one (the first
        push of each is checked) would otherwise change every later sample (dynamic sampling's extra round first)."""
        import torch

        self.schedule.due = False
        self.schedule.checks += 1
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            self._check_sync(model, prompts, out)

    def _check_sync(self, model: nn.Module, prompts: PromptBatch, out: Rollout) -> None:
        """The weight-sync check on the rollout the engine just sampled (`sync_check`); WeightSyncError on every
        process when it fails."""
        import torch
        from accelerate.utils import gather

        from grpo_trainer.modeling.logprobs import completion_logprobs
        from grpo_trainer.rollout.multimodal import forward_inputs

        rows = sync_check.probe_rows(out, sync_check.PROBE_ROWS)
        completions = [ids[m.bool()].tolist() for ids, m in zip(out.completion_ids[rows], out.completion_mask[rows])]
        requests = self._probe_requests(prompts, rows.tolist(), completions)
        scores = self.engine.score(requests) if self.engine is not None else self._score_on_server(requests)
        mask = out.completion_mask[rows]  # [k, T]
        engine = sync_check.engine_completion_logps(scores, mask.sum(1).tolist(), mask.shape[1]).to(mask.device)
        ids = torch.cat([out.prompt_ids[rows], out.completion_ids[rows]], 1)
        attention = torch.cat([out.prompt_mask[rows], mask], 1)
        images = None if prompts.images is None else prompts.images.select_rows(rows)
        with torch.no_grad():
            trainer = completion_logprobs(model, ids, attention, mask.shape[1], 1.0,
                                          model_inputs=forward_inputs(model, images, mask.shape[1])).logps
        gap, tokens = sync_check.logp_gap(engine, trainer, mask)
        gaps = gather(torch.stack([gap, tokens.float()]).reshape(1, 2))  # [processes, 2]; decision 4
        worst = int(gaps[:, 0].argmax())
        dtype = self._policy_dtype()
        tolerance = sync_check.logp_tolerance(dtype)
        self.schedule.gaps.append((float(gaps[worst, 0]), int(gaps[worst, 1])))
        if float(gaps[worst, 0]) <= tolerance:
            return
        diagnosis = self._diagnose()
        raise sync_check.WeightSyncError(sync_check.failure_message(
            float(gaps[worst, 0]), tolerance, int(gaps[worst, 1]), self.schedule.pushes, self.loaded,
            str(dtype).removeprefix("torch."), diagnosis))

    def _probe_requests(self, prompts: PromptBatch, rows: list[int], completions: list[list[int]]
                        ) -> list[sampling.Request]:
        """The probed rows as requests to score: prompt (as the engine takes it) and completion tokens, images."""
        engine_ids = self.engine_ids(prompts) if _has_images(prompts) else {}
        requests = []
        for row, completion in zip(rows, completions):
            images = prompts.image_lists[row] if prompts.image_lists is not None else None
            prompt = engine_ids[row] if images else sampling.row_ids(prompts, row)
            requests.append(sampling.Request(prompt + completion, 1, images or None))
        return requests

    def _policy_dtype(self) -> Any:
        return next(p.dtype for p in causal_lm(self.policy).parameters() if p.is_floating_point())

    def _score_on_server(self, requests: list[sampling.Request]) -> list[list[float | None]]:
        """Every process's requests scored by the main process; this process's scores."""
        from accelerate import PartialState
        from accelerate.utils import gather_object

        everyone = gather_object([requests])
        scores = failure = None
        if self.is_main:
            try:
                scores = self.client.score([r for part in everyone for r in part])
            except Exception as exc:  # noqa: BLE001  (raised on every process below)
                failure = exc
        scores, failure = self._shared((scores, failure))
        if failure is not None:
            raise failure
        start = sum(len(part) for part in everyone[:PartialState().process_index])
        return scores[start:start + len(requests)]

    def _diagnose(self) -> sync_check.Diagnosis:
        """Decision 3 of `sync_check`: the engine's weights under checkpoint names against the policy's."""
        from grpo_trainer.modeling.export import inference_weight_metadata, inference_weights
        from grpo_trainer.rollout.vllm.inspection import digest, encode_metadata

        metadata = encode_metadata(inference_weight_metadata(self.policy))
        answer = reason = None
        if self.engine is not None:
            answer = self.engine.inspect("grpo_checkpoint_digests", metadata)
        elif self.is_main:
            if self.client.inspection:
                answer = self.client.inspect("grpo_checkpoint_digests", metadata)
            else:
                reason = (f"the server at {self.client.url} has no weight inspection; start it with `grpo-train "
                          "vllm-serve` to have the differing parameters named.")
        answer, reason = self._shared((answer, reason))
        if answer is None:
            return sync_check.Diagnosis(available=False, reason=reason or "")
        import torch

        dtype = getattr(torch, answer["dtype"])
        wanted = answer["digests"]
        expected = {name: digest(tensor.to(dtype)) for name, tensor in inference_weights(self.policy)
                    if name in wanted}  # every process iterates: the gathers are collectives
        return sync_check.Diagnosis(
            available=True, compared=len(expected), differing=sync_check.differing_weights(expected, wanted),
            unmapped=answer["unmapped"], uncompared=answer["uncompared"], unreached=self.schedule.unreached)

    def _generate_on_server(self, requests: list[sampling.Request], settings: dict
                            ) -> tuple[list[sampling.Completion], list[list[int] | None]]:
        """Every process's requests answered by the main process; this process's completions, and its requests'
        prompts as the server expanded them (decision 2)."""
        from accelerate import PartialState
        from accelerate.utils import gather_object

        everyone = gather_object([requests])  # one list of requests per process
        answer = failure = None
        if self.is_main:
            try:
                answer = self.client.generate([r for part in everyone for r in part], settings)
            except Exception as exc:  # noqa: BLE001  (raised on every process below, so none waits forever)
                failure = exc
        answer, failure = self._shared((answer, failure))
        if failure is not None:
            raise failure
        completions, seen = answer
        me = PartialState().process_index
        rows = [sum(r.n for r in part) for part in everyone]
        first_request = sum(len(part) for part in everyone[:me])
        return (completions[sum(rows[:me]):sum(rows[:me]) + rows[me]],
                seen[first_request:first_request + len(requests)])
