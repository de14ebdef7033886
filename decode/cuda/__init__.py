"""Decode machinery of the GPU path: the step function every decode step runs
(eager on any device, or captured), the captured decode steps and the warm-up
before serving."""
