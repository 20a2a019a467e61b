"""On-policy distillation (``algorithm.estimator: opd``): a teacher engine scores each token the student
generated, and the teacher-minus-student log-ratio is that token's advantage.

The student acts as in RL: the unmodified agent's calls go through lgt-proxy, which records the prompt
ids, the generated ids and their behaviour logprobs; the store merges them into samples. Each step,
after admission (:mod:`lgt.trainer.run.admission`), every sample's ``input_ids`` go to the **teacher**, a
second vLLM engine serving any model with the student's tokenizer, as a completion whose prompt is those
ids (``POST /v1/completions``, ``prompt_logprobs: 0``, ``max_tokens: 1``: vLLM returns the logprob of
each prompt token given the ones before it; the one token it generates is ignored). A generated token
``t`` of the sample gets the advantage

    A_t = (log p_teacher(t) − log p_student(t)) + opd_reward_coef · A_group

where ``log p_student(t)`` is the behaviour logprob the proxy recorded (the trainer's own logprob before
the update where the engine gave none: :func:`lgt.trainer.rl.loss.fill_behaviour`'s rule) and
``A_group`` the sample's GRPO group advantage (the ``opd`` estimator, :mod:`lgt.trainer.rl.algorithm`);
tokens off the loss mask get 0. Summed over a sequence, ``−A`` is the sampled estimate of the reverse KL
``KL(student ‖ teacher)`` (Thinking Machines' "on-policy distillation": per-token reverse KL, no
discounting, advantages detached), so the policy-gradient loss pushes the student towards the teacher's
choices on the states the student itself reaches. The advantage enters the same PPO loss as RL's
(importance weights against the behaviour logprobs, clipping), per token (``token_advantage``).

Departures, on purpose: the teacher scores the whole merged sample (prompt, tool output and all) in one
request, even though only the generated tokens' logprobs are used: it sees the exact context the
student saw. A teacher at ``url`` is not restarted (it is not this run's); a started one is, like the
student's engine, at most ``restarts`` times.

This module is the pure math (:func:`token_advantages`); the teacher, its ``teacher:`` section, its
tokenizer check and its engine and scoring client are :mod:`lgt.trainer.distill.teacher`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa


def _lists(samples: pa.Table, name: str) -> list[np.ndarray]:
    col = samples.column(name).combine_chunks()
    offsets = col.offsets.to_numpy()
    values = col.values.to_numpy(zero_copy_only=False)
    return [values[offsets[i]:offsets[i + 1]] for i in range(len(col))]


def token_advantages(samples: pa.Table, teacher: Sequence[np.ndarray], coef: float,
                     recomputed: Sequence[np.ndarray] | None = None,
                     top: tuple[Sequence[np.ndarray], Sequence[np.ndarray]] | None = None
                     ) -> tuple[pa.Table, dict[str, float]]:
    """``samples`` (with ``advantage``: the group's, from :func:`lgt.trainer.rl.algorithm.assign`) with
    ``teacher_logprobs`` and ``token_advantage`` (list<float32>, aligned with ``input_ids``) set:
    ``token_advantage = (teacher − student) + coef · advantage`` on the loss mask, 0 elsewhere. The
    student's logprob is ``behaviour_logprobs``; where that is NaN (not recorded) ``recomputed`` (the
    trainer's own, same alignment) stands in, and without it ValueError names the sample.

    ``top``: the teacher's top-k ids and logprobs per sample ((L, k) each,
    :func:`lgt.trainer.distill.teacher.prompt_top_k_of`); they become ``teacher_top_k_ids``
    (list<int32>) and ``teacher_top_k_logprobs`` (list<float32>), k per token flattened row-major, zeros
    off the loss mask (the torch backend's top-k KL term).

    Metrics, over the generated (loss-mask) tokens of the batch: ``opd/reverse_kl`` (mean of student −
    teacher: the sampled estimate of KL(student ‖ teacher) per token), ``opd/teacher_logprob_mean``,
    ``opd/student_logprob_mean``, ``opd/tokens``; with ``top``: ``opd/top_k_mass`` (the teacher's
    probability inside its top k, mean) and ``opd/top1_agree`` (the fraction of generated tokens that
    are the teacher's most likely one)."""
    ids, masks, behaviour = _lists(samples, "input_ids"), _lists(samples, "loss_mask"), \
        _lists(samples, "behaviour_logprobs")
    if len(teacher) != samples.num_rows:
        raise ValueError(f"{len(teacher)} teacher logprob lists for {samples.num_rows} samples")
    group_adv = samples.column("advantage").to_numpy(zero_copy_only=False).astype(np.float64)
    sample_ids = samples.column("sample_id").to_pylist()
    adv_rows, teacher_rows, top_id_rows, top_lp_rows = [], [], [], []
    kl_sum = t_sum = s_sum = mass_sum = agree_sum = 0.0
    n = 0
    if top is not None and not (len(top[0]) == len(top[1]) == samples.num_rows):
        raise ValueError(f"{len(top[0])} teacher top-k lists for {samples.num_rows} samples")
    for i, (tok, mask, blp, tlp) in enumerate(zip(ids, masks, behaviour, teacher)):
        tlp = np.asarray(tlp, np.float64)
        if len(tlp) != len(tok):
            raise ValueError(f"sample {sample_ids[i]}: {len(tlp)} teacher logprobs for {len(tok)} tokens")
        on = np.asarray(mask) != 0
        student = np.asarray(blp, np.float64)
        missing = on & np.isnan(student)
        if missing.any():
            if recomputed is None:
                raise ValueError(f"sample {sample_ids[i]} has generated tokens without behaviour logprobs "
                                 "and no recomputed ones were given")
            student = np.where(missing, np.asarray(recomputed[i], np.float64), student)
        diff = np.where(on, tlp - np.where(on, student, 0.0), 0.0)
        adv = np.where(on, diff + coef * group_adv[i], 0.0)
        if not np.isfinite(adv).all():
            raise ValueError(f"sample {sample_ids[i]} gets a non-finite token advantage (teacher or student "
                             "logprob not finite)")
        adv_rows.append(adv.astype(np.float32))
        teacher_rows.append(np.where(on, tlp, 0.0).astype(np.float32))
        if top is not None:
            t_ids, t_lps = np.asarray(top[0][i]), np.asarray(top[1][i])
            if t_ids.shape != t_lps.shape or t_ids.ndim != 2 or len(t_ids) != len(tok):
                raise ValueError(f"sample {sample_ids[i]}: teacher top-k of shape {t_ids.shape} for "
                                 f"{len(tok)} tokens")
            top_id_rows.append(np.where(on[:, None], t_ids, 0).astype(np.int32).ravel())
            top_lp_rows.append(np.where(on[:, None], t_lps, 0.0).astype(np.float32).ravel())
            mass_sum += float(np.exp(t_lps[on].astype(np.float64)).sum())
            agree_sum += float((t_ids[on, 0] == np.asarray(tok)[on]).sum())
        kl_sum -= float(diff.sum())
        t_sum += float(tlp[on].sum())
        s_sum += float(student[on].sum())
        n += int(on.sum())
    out = samples
    columns = [("teacher_logprobs", teacher_rows, pa.float32()), ("token_advantage", adv_rows, pa.float32())]
    if top is not None:
        columns += [("teacher_top_k_ids", top_id_rows, pa.int32()),
                    ("teacher_top_k_logprobs", top_lp_rows, pa.float32())]
    for name, rows, kind in columns:
        if name in out.column_names:
            out = out.drop_columns([name])
        out = out.append_column(name, pa.array(rows, pa.list_(kind)))
    nan = float("nan")
    metrics = {"opd/reverse_kl": kl_sum / n if n else nan,
               "opd/teacher_logprob_mean": t_sum / n if n else nan,
               "opd/student_logprob_mean": s_sum / n if n else nan, "opd/tokens": float(n)}
    if top is not None:
        metrics.update({"opd/top_k_mass": mass_sum / n if n else nan,
                        "opd/top1_agree": agree_sum / n if n else nan})
    return out, metrics


def needs_recompute(samples: pa.Table) -> bool:
    """Whether a generated token of ``samples`` has no recorded behaviour logprob (NaN)."""
    for mask, blp in zip(_lists(samples, "loss_mask"), _lists(samples, "behaviour_logprobs")):
        if (np.isnan(blp) & (np.asarray(mask) != 0)).any():
            return True
    return False
