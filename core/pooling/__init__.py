"""Pooling models: what turns a prompt's hidden states into one vector (an embedding) or a
classifier's scores, and the per-request settings of it. The engine schedules pooling
requests like prompts that stop after their prefill (core/sched/scheduler.py). May import
models and what they may."""
