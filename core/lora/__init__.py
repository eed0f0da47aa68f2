"""LoRA serving: adapters in PEFT's format, the manager that knows them by name, the slot
table of the `max_loras` slots, and the layers that add a slot's delta. May import
model_loader, models, layers and below.
"""
