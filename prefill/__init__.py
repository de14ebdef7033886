"""Prefill side: CP planner, owner-lane layout and allocator, the CP engine (``prefill.cp``), daemon."""
