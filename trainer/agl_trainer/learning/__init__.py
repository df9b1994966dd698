"""Algorithms and updates: group advantages (``algo``), the PPO-clip and fine-tuning steps (``update``,
``finetune``), the trainable policy with its optimizer and publishing (``policy``), the verl update, and
checkpoints."""
