"""Prefill side: CP planner, owner-lane layout and allocator, model, CP runner, daemon."""
