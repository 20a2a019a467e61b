"""The trainer backend interface, its registry, and each backend's config. No torch, no verl here.

A backend trains the policy on batches of samples. What the run (:mod:`lgt.trainer.recipe`), SFT
(:mod:`lgt.trainer.distill.sft`) and on-policy distillation call on one is :class:`Backend`::

    backend = Backend.load(model_dir, cfg)            # or: backend, extra = Backend.resume(ckpt, cfg)
    metrics = backend.train_step(samples)             # one update on a pyarrow table of samples
    logprobs = backend.sample_logprobs(samples)       # the policy's log-prob of every token (OPD)
    engine.update_weights(backend.named_weights())    # the new weights into the running engine
    if backend.lora is not None:                      # a LoRA adapter is trained on the frozen base:
        backend.save_adapter(path)                    # it as a PEFT folder (vLLM's --enable-lora loads it)
    ckpt = backend.save_checkpoint(root, extra)       # an HF model dir (or adapter) + the backend's state
    backend.close()

Each reads the table with :func:`lgt.trainer.backends.samples.read_samples`. :data:`BACKENDS` maps a
name to its config class (defined here, so a run config is checked in milliseconds without importing
torch or verl) and to the class that trains, imported only when a run starts. ``backend.name`` in a
run config picks one; the rest of the section is that backend's config. Loss settings are not part of
it: they come from the run's ``algorithm`` section (:class:`lgt.trainer.rl.algorithm.LossConfig`), the
same for every backend.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from lgt.trainer.rl.algorithm import AGG_MODES, LossConfig


class BackendError(ValueError):
    """A backend setting or environment that cannot work; one sentence naming it."""


class Backend(Protocol):
    """A policy being trained and its optimizer state (``tests/trainer/test_backend_contract.py`` holds
    every backend in :data:`BACKENDS` to these names and signatures).

    ``samples`` is a pyarrow table of the store's samples with the trainer's columns (N rows:
    ``sample_id``, ``input_ids``, ``loss_mask``, ``behaviour_logprobs`` as lists of T_i entries,
    ``advantage`` and ``loss_weight``; optionally ``token_advantage`` and the teacher's top k), as
    :func:`lgt.trainer.backends.samples.read_samples` reads and checks it (SampleError otherwise).
    """

    summary: str  # one line for the run's log (device, dtype, what it trains); "" when there is none
    lora: LoraConfig | None  # the adapter being trained on the frozen base (backend.lora), None: every weight

    @classmethod
    def load(cls, model_dir: str | Path, cfg: Any) -> Backend:
        """The model in the Hugging Face directory ``model_dir``, ready to train under ``cfg`` (its
        config class in :data:`BACKENDS`)."""
        ...

    @classmethod
    def resume(cls, ckpt_dir: str | Path, cfg: Any) -> tuple[Backend, dict[str, Any]]:
        """The backend as ``save_checkpoint`` left it in ``ckpt_dir`` (weights, optimizer, update count),
        and the ``extra`` it was saved with; CheckpointError when that is no finished checkpoint."""
        ...

    def train_step(self, samples: Any) -> dict[str, float]:
        """One update of the policy on every sample (a backend may split it into micro- or
        mini-batches); its metrics as floats (``loss/pg``, ``actor/*``, token and sample counts)."""
        ...

    def sample_logprobs(self, samples: Any) -> list[Any]:
        """The current policy's log-prob of every token of every sample: N float32 numpy arrays, row i
        of length T_i aligned with its ``input_ids`` (0 where a backend scores nothing: the first token,
        and on verl everything before the first generated one)."""
        ...

    def named_weights(self) -> Iterator[tuple[str, Any]]:
        """``(Hugging Face parameter name, tensor)`` for every weight, what ``Engine.update_weights``
        takes; the tensors may be views of the live weights: use them before the next ``train_step``.
        With ``lora`` these are the base model's names and the MERGED weights (base + the adapter's
        update), so an engine that cannot serve adapters gets the current policy the usual way."""
        ...

    def save_adapter(self, path: str | Path) -> Path:
        """The current LoRA adapter written as a PEFT folder at ``path`` (``adapter_config.json`` +
        ``adapter_model.safetensors``: what vLLM's ``--enable-lora`` / ``POST /v1/load_lora_adapter``
        loads), and ``path``; BackendError when this backend trains no adapter (``lora`` is None) or
        cannot write it (verl keeps its adapter inside its FSDP engine and gives it merged only)."""
        ...

    def save_checkpoint(self, root: str | Path, extra: dict[str, Any] | None = None, *,
                        name: int | None = None) -> Path:
        """``root/step-<name:08d>`` (default: the update count): an HF model directory vLLM can serve
        (with ``lora``: the adapter folder instead, the base being the run's model), the backend's own
        state, the JSON-serialisable ``extra``, ``DONE`` written last
        (:mod:`lgt.trainer.backends.checkpoints`)."""
        ...

    def close(self) -> None:
        """Free the model (and whatever the backend started to train it)."""
        ...


def _positive_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BackendError(f"{name} must be a positive integer{' or null' if allow_none else ''}, "
                           f"not {value!r}")


def _finite(name: str, value: Any, low: float, *, strict: bool) -> None:
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
          and (value > low if strict else value >= low))
    if not ok:
        raise BackendError(f"{name} must be a finite number {'>' if strict else '>='} {low:g}, not {value!r}")


# Llama-shaped models' attention and MLP projections (llama, qwen2, mistral, SmolLM2, the demo model):
# backend.lora trains those of them the model has unless target_modules names others
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraConfig:
    """``backend.lora``: train a LoRA adapter (PEFT's) instead of every weight; the base stays frozen.

    ``rank``: the adapter's rank r; ``alpha``: its scale numerator (the update is ``alpha / rank * B A``);
    ``dropout``: on the adapter's input while training, in [0, 1) (0 by default: the log-probs trained are
    then the ones the engine sampled from); ``target_modules``: the names of the linear layers that get
    an adapter (the last part of a module's name, e.g. ``q_proj``), default: those of
    :data:`DEFAULT_LORA_TARGETS` the model has. Names the model does not have are refused when it loads.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        _positive_int("backend.lora.rank", self.rank)
        _finite("backend.lora.alpha", self.alpha, 0, strict=True)
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) \
                or not 0.0 <= self.dropout < 1.0:
            raise BackendError(f"backend.lora.dropout must be a number in [0, 1), not {self.dropout!r}")
        if self.target_modules is not None and (
                not self.target_modules or not all(isinstance(t, str) and t for t in self.target_modules)):
            raise BackendError("backend.lora.target_modules must be a list of module names (e.g. [q_proj, "
                               f"v_proj]) or null (the attention and MLP projections), not "
                               f"{self.target_modules!r}")


def lora_targets(cfg: LoraConfig, have: list[str], kind: str) -> list[str]:
    """The module names an adapter of ``cfg`` goes on, given the linear layers ``have`` a model of class
    ``kind`` has (by last name); BackendError (one sentence naming the ones it has) for a target it
    lacks, or, by default, when it has none of :data:`DEFAULT_LORA_TARGETS`. Used when the config is
    checked (the layers read from the weights files) and when the model loads (from its modules)."""
    if cfg.target_modules is None:
        chosen = [t for t in DEFAULT_LORA_TARGETS if t in have]
        if not chosen:
            raise BackendError(f"backend.lora found none of {', '.join(DEFAULT_LORA_TARGETS)} in this "
                               f"{kind}: set backend.lora.target_modules to some of "
                               f"{', '.join(have) or 'nothing'}")
        return chosen
    missing = [t for t in cfg.target_modules if t not in have]
    if missing:
        raise BackendError(f"backend.lora.target_modules names {', '.join(missing)}, which this {kind} does "
                           f"not have: the linear layers it has are {', '.join(have) or 'none'}")
    return list(dict.fromkeys(cfg.target_modules))


@dataclass(frozen=True)
class TorchConfig:
    """How the torch backend trains (CPU or one GPU, any Hugging Face causal LM).

    ``micro_batch_tokens``: budget of padded tokens (rows x longest row) per forward/backward.
    ``max_seq_len``: longest sample accepted (default: the model's ``max_position_embeddings``; a run
    sets the engine's ``max_model_len``). ``device``: ``auto`` (cuda when available, else cpu), ``cpu``,
    ``cuda`` or ``cuda:N``. ``dtype``: ``float32``, ``bfloat16`` (autocast compute; weights and
    optimizer stay float32), or ``auto``: bfloat16 where the device computes in bf16 natively (a CPU
    with avx512_bf16 or amx_bf16, a GPU with bf16), else float32 (:mod:`lgt.trainer.serving.hardware`).
    ``train_layers``: train only the top N decoder layers and the final norm (``model.model.layers``:
    llama, qwen2, mistral …), everything below frozen, out of AdamW and of backward; ``None`` trains
    every parameter. ``train_embeddings``: with ``train_layers``, also train the input embedding and the
    output head (one tensor when tied); frozen by default. ``ref_model``: load a frozen copy of the
    starting weights for the KL term; ``None`` means "when ``loss.kl_coef > 0``". ``grad_clip``: max
    global gradient norm, ``None`` to not clip. ``entropy``: also report the exact mean entropy over
    trained tokens (``actor/entropy``; one more pass over the logits). ``updates_per_step``: optimizer
    steps per training step, each on its share of the batch's groups. ``epochs``: passes over each
    share, each an optimizer step (PPO epochs: the first pass's log-probs are the ratio's old policy,
    so later passes are clipped against it). ``lora``: train a LoRA adapter (:class:`LoraConfig`) on
    the frozen model instead of its weights (``None``: full fine-tuning).
    ``loss`` comes from the run's ``algorithm`` section.
    """

    name: str = "torch"
    PASSES: ClassVar[str] = "epochs"  # the field of passes over each batch (SFT sets it to 1)
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    micro_batch_tokens: int = 4096
    max_seq_len: int | None = None
    device: str = "auto"
    dtype: str = "float32"
    train_layers: int | None = None
    train_embeddings: bool = False
    seed: int = 0
    grad_checkpointing: bool = False
    ref_model: bool | None = None
    entropy: bool = False
    updates_per_step: int = 1
    epochs: int = 1
    lora: LoraConfig | None = None
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self) -> None:
        _finite("backend.lr", self.lr, 0, strict=True)
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise BackendError(f"backend.lora must be a LoraConfig, not {type(self.lora).__name__}")
        if self.lora is not None and (self.train_layers is not None or self.train_embeddings):
            raise BackendError("backend.lora and backend.train_layers/train_embeddings cannot be combined: "
                               "with lora every weight of the model stays frozen and only the adapter "
                               "trains (unset train_layers and train_embeddings)")
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0
                                           for b in self.betas):
            raise BackendError(f"backend.betas must be two numbers in [0, 1), not {self.betas!r}")
        _finite("backend.eps", self.eps, 0, strict=True)
        _finite("backend.weight_decay", self.weight_decay, 0, strict=False)
        if self.grad_clip is not None:
            _finite("backend.grad_clip", self.grad_clip, 0, strict=True)
        _positive_int("backend.micro_batch_tokens", self.micro_batch_tokens)
        if self.max_seq_len is not None and not (isinstance(self.max_seq_len, int) and self.max_seq_len > 1):
            raise BackendError(f"backend.max_seq_len must be an integer > 1 or null (the model's limit), "
                               f"not {self.max_seq_len!r}")
        if self.dtype not in TORCH_DTYPES:
            raise BackendError(f"backend.dtype must be one of {', '.join(TORCH_DTYPES)}, not {self.dtype!r}")
        _positive_int("backend.train_layers", self.train_layers, allow_none=True)
        if not isinstance(self.train_embeddings, bool):
            raise BackendError(f"backend.train_embeddings must be true or false, "
                               f"not {self.train_embeddings!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise BackendError(f"backend.device must be auto, cpu, cuda or cuda:N, not {self.device!r}")
        _positive_int("backend.updates_per_step", self.updates_per_step)
        _positive_int("backend.epochs", self.epochs)
        if not isinstance(self.loss, LossConfig):
            raise BackendError(f"loss must be a LossConfig, not {type(self.loss).__name__}")
        if self.ref_model is False and self.loss.kl_coef > 0:
            raise BackendError(f"algorithm.kl_coef is {self.loss.kl_coef} but backend.ref_model is false: "
                               "the KL term needs the reference model (set ref_model to null or true, or "
                               "kl_coef to 0)")

    @property
    def wants_ref_model(self) -> bool:
        return self.loss.kl_coef > 0 if self.ref_model is None else self.ref_model


TORCH_DTYPES = ("float32", "bfloat16", "auto")
VERL_STRATEGIES = ("fsdp", "fsdp2")
VERL_PARAM_DTYPES = ("auto", "bf16", "fp16", "fp32")
VERL_OLD_LOGPROBS = ("behaviour", "recompute")
# lgt's loss aggregation -> verl's loss_agg_mode ("rollout": token-sum, the weights in the advantages)
VERL_AGG = {"rollout": "token-sum", "token-mean": "token-mean",
            "seq-mean-token-mean": "seq-mean-token-mean", "seq-mean-token-sum": "seq-mean-token-sum"}
VERL_KL = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}
NO_DUAL_CLIP = 1e9  # verl always applies its dual clip (clip_ratio_c > 1): this bound never bites
assert set(VERL_AGG) == set(AGG_MODES), "every lgt loss aggregation has a verl mode"


@dataclass(frozen=True)
class VerlConfig:
    """The verl backend: verl's FSDP actor (``TrainingWorker`` + ``ppo_loss``), in this process for
    ``world_size: 1``, on verl's own Ray worker groups for more.

    Batch sizes are in samples per update call. ``ppo_mini_batch_size=None`` makes the whole batch one
    optimizer step; an int splits it into batch/mini steps (the batch must divide evenly).
    ``old_logprobs``: "behaviour" (the PPO ratio against the recorded logprobs) or "recompute"
    (against a forward pass before the update, with the ``loss``'s importance weights for the
    behaviour mismatch). ``param_dtype``: FSDP's compute dtype (``fp32``: no autocast; ``auto``: bf16
    on a GPU, fp32 on CPU). ``micro_batch_tokens``: micro-batches packed by a budget of tokens per rank
    (verl's dynamic batch size), as the torch backend's; unset: ``ppo_micro_batch_size_per_gpu`` rows.
    ``lora``: verl's own LoRA (PEFT inside its FSDP engine; no dropout there) with lgt's settings and
    default targets; the weights it gives the engine and the checkpoints are the adapter merged in.
    ``world_size``: training ranks (FSDP shards); more than 1 runs on Ray: ``ray_address`` joins an
    existing cluster (``auto``, or ``host:port``), otherwise a local one is started with the run and
    stopped after it. ``model_path`` is set by the run (the model being trained); ``loss`` by the
    run's ``algorithm`` section: clip range, dual clip, importance weights, KL and the aggregation
    (lgt's ``rollout`` runs as verl's ``token-sum`` with the loss weights folded into the advantages).
    """

    name: str = "verl"
    PASSES: ClassVar[str] = "ppo_epochs"  # the field of passes over each batch (SFT sets it to 1)
    model_path: str = ""
    lr: float = 1e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    ppo_mini_batch_size: int | None = None
    ppo_micro_batch_size_per_gpu: int = 4
    micro_batch_tokens: int | None = None  # micro-batches by a token budget per rank (verl's dynamic bsz)
    ppo_epochs: int = 1
    entropy_coeff: float = 0.0
    temperature: float = 1.0
    old_logprobs: str = "behaviour"
    max_prompt_len: int | None = None
    max_response_len: int | None = None
    strategy: str = "fsdp2"
    param_dtype: str = "auto"
    attn_implementation: str = "sdpa"
    use_remove_padding: bool = False
    gradient_checkpointing: bool = False
    shuffle: bool = False
    seed: int = 42
    world_size: int = 1
    ray_address: str | None = None
    python: str | None = None  # an interpreter with verl when this one has none (preflight.backend_python)
    updates_per_step: int = 1
    lora: LoraConfig | None = None  # verl's own LoRA (HFModelConfig.lora_rank …): see to_verl_model
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self) -> None:
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise BackendError(f"backend.lora must be a LoraConfig, not {type(self.lora).__name__}")
        if self.lora is not None and self.lora.dropout:
            raise BackendError(f"backend.lora.dropout is {self.lora.dropout} but verl's LoRA has no dropout: "
                               "leave it at 0 on the verl backend (or use backend.name: torch)")
        _finite("backend.lr", self.lr, 0, strict=True)
        _finite("backend.weight_decay", self.weight_decay, 0, strict=False)
        _finite("backend.grad_clip", self.grad_clip, 0, strict=True)
        for name in ("ppo_micro_batch_size_per_gpu", "ppo_epochs", "world_size", "updates_per_step"):
            _positive_int(f"backend.{name}", getattr(self, name))
        for name in ("ppo_mini_batch_size", "max_prompt_len", "max_response_len", "micro_batch_tokens"):
            _positive_int(f"backend.{name}", getattr(self, name), allow_none=True)
        mini, micro = self.ppo_mini_batch_size, self.ppo_micro_batch_size_per_gpu
        if mini is not None and not self.use_dynamic_bsz and mini % micro:
            raise BackendError(f"backend.ppo_mini_batch_size ({mini}) must be a multiple of "
                               f"backend.ppo_micro_batch_size_per_gpu ({micro})")
        _finite("backend.entropy_coeff", self.entropy_coeff, 0, strict=False)
        _finite("backend.temperature", self.temperature, 0, strict=True)
        if not isinstance(self.loss, LossConfig):
            raise BackendError(f"loss must be a LossConfig, not {type(self.loss).__name__}")
        if self.loss.agg == "rollout" and (self.entropy_coeff or self.loss.kl_coef):
            raise BackendError("backend.entropy_coeff and algorithm.kl_coef must be 0 with algorithm.agg "
                               "rollout on verl: verl sums those terms over tokens without the rollout "
                               "weights")
        for name, value, choices in (("old_logprobs", self.old_logprobs, VERL_OLD_LOGPROBS),
                                     ("strategy", self.strategy, VERL_STRATEGIES),
                                     ("param_dtype", self.param_dtype, VERL_PARAM_DTYPES)):
            if value not in choices:
                raise BackendError(f"backend.{name} must be one of {', '.join(choices)}, not {value!r}")
        if self.ray_address is not None and not self.ray_address:
            raise BackendError("backend.ray_address must be auto, host:port, or null (a local Ray)")

    @property
    def verl_loss_agg_mode(self) -> str:
        return VERL_AGG[self.loss.agg]

    @property
    def use_dynamic_bsz(self) -> bool:
        """verl packs micro-batches by tokens (``micro_batch_tokens``) instead of by rows."""
        return self.micro_batch_tokens is not None

    @property
    def ppo_max_token_len_per_gpu(self) -> int:
        return self.micro_batch_tokens or 16384

    @property
    def verl_param_dtype(self) -> str:
        """``param_dtype`` with ``auto`` resolved: bf16 on a GPU, fp32 on CPU."""
        if self.param_dtype != "auto":
            return self.param_dtype
        import torch

        return "bf16" if torch.cuda.is_available() else "fp32"

    def to_verl(self, *, mini_batch_size: int | None = None):
        """verl's ``FSDPActorConfig`` for these settings (``mini_batch_size`` fills a ``None`` mini batch)."""
        from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig

        mini = self.ppo_mini_batch_size or mini_batch_size or self.ppo_micro_batch_size_per_gpu
        loss = self.loss
        engine = FSDPEngineConfig(
            strategy=self.strategy, use_torch_compile=False, seed=self.seed,
            mixed_precision={"param_dtype": self.verl_param_dtype, "reduce_dtype": "fp32",
                             "buffer_dtype": "fp32"},
        )
        return FSDPActorConfig(
            strategy=self.strategy, rollout_n=1, ppo_mini_batch_size=mini,
            ppo_micro_batch_size_per_gpu=self.ppo_micro_batch_size_per_gpu,
            use_dynamic_bsz=self.use_dynamic_bsz, ppo_max_token_len_per_gpu=self.ppo_max_token_len_per_gpu,
            clip_ratio=loss.clip_low, clip_ratio_low=loss.clip_low, clip_ratio_high=loss.clip_high,
            clip_ratio_c=loss.dual_clip or NO_DUAL_CLIP,
            loss_agg_mode=self.verl_loss_agg_mode, entropy_coeff=self.entropy_coeff,
            use_kl_loss=loss.kl_coef > 0, kl_loss_coef=loss.kl_coef, kl_loss_type=VERL_KL[loss.kl_kind],
            ppo_epochs=self.ppo_epochs, shuffle=self.shuffle, data_loader_seed=self.seed,
            grad_clip=self.grad_clip, use_torch_compile=False, use_remove_padding=self.use_remove_padding,
            optim=FSDPOptimizerConfig(lr=self.lr, weight_decay=self.weight_decay, clip_grad=self.grad_clip),
            fsdp_config=engine,
        )

    def to_verl_model(self):
        """verl's ``HFModelConfig`` for ``model_path`` (reads config and tokenizer; loads no weights)."""
        from verl.workers.config import HFModelConfig

        if not self.model_path:
            raise BackendError("the verl backend needs model_path (a Hugging Face model directory)")
        lora: dict[str, Any] = {}
        if self.lora is not None:  # merge: verl's weights for the engine (and checkpoints) are merged
            lora = {"lora_rank": self.lora.rank, "lora_alpha": self.lora.alpha, "lora": {"merge": True},
                    "target_modules": self.verl_lora_targets()}
        return HFModelConfig(
            path=self.model_path, use_remove_padding=self.use_remove_padding,
            enable_gradient_checkpointing=self.gradient_checkpointing,
            override_config={"attn_implementation": self.attn_implementation}, **lora,
        )

    def verl_lora_targets(self) -> list[str]:
        """``lora``'s target modules for the model at ``model_path`` (its linear layers read from its
        safetensors headers: :func:`lora_targets`)."""
        from lgt.trainer.model_dir import check_model_dir, linear_layer_names

        assert self.lora is not None
        info = check_model_dir(self.model_path)
        have = linear_layer_names(self.model_path, info.vocab_size)
        if have is None:  # no safetensors file to read: verl (PEFT) checks the names itself
            return list(self.lora.target_modules or DEFAULT_LORA_TARGETS)
        return lora_targets(self.lora, have, info.architecture)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend: its config class, where its trainer class lives, what it must import."""

    config: type
    module: str
    cls: str
    needs: str  # a module the trainer class needs in this interpreter

    def available(self) -> bool:
        """The package is installed for this interpreter (a bare folder of that name, a namespace
        package such as a checkout's ``tests/verl`` on ``sys.path``, does not count)."""
        spec = importlib.util.find_spec(self.needs)
        return spec is not None and spec.origin not in (None, "namespace")

    def load_class(self) -> Any:
        return getattr(importlib.import_module(self.module), self.cls)


BACKENDS: dict[str, BackendEntry] = {
    "torch": BackendEntry(TorchConfig, "lgt.trainer.backends.torch_backend", "TorchBackend", "torch"),
    "verl": BackendEntry(VerlConfig, "lgt.trainer.backends.verl_backend", "VerlBackend", "verl"),
}


def entry(name: str) -> BackendEntry:
    if name not in BACKENDS:
        raise BackendError(f"backend.name must be one of {', '.join(BACKENDS)}, not {name!r}")
    return BACKENDS[name]
