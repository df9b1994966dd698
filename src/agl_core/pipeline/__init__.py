"""The pure pipeline from a rollout's spans to what the trainer learns from, with no I/O: one reading of
the span tree (``spantree``), MDP transitions (``transitions``), credit assignment (``credit``), supervised
fine-tuning examples (``sft``), late rewards (``rewards``) and a rollout's human-readable report
(``report``)."""
