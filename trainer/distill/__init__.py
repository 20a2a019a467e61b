"""Learning from a stronger model before (or beside) RL: supervised fine-tuning on a teacher's recorded
traces (``sft``) and on-policy distillation, a teacher scoring every token the student generated
(``teacher``, ``opd``; ``onpolicy``: that step as the training step calls it)."""
