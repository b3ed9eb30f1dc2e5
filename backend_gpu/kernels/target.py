"""What a launch plan is made for: the GPU the kernels run on, or the one the interpreter plays.

A plan (tile rows, key tiles, warps, stages, how many KV splits, tokens per
program) is a function of the batch and of a :class:`LaunchTarget`. On CUDA
the target is the device itself, with its SM count. Under Triton's CPU
interpreter it is, by default, :data:`H200` (an sm_90 GPU with 132 SMs): the
interpreter then runs the very tiles, split counts and paths that GPU runs,
so a bug that lives only in the GPU's plan shows on a CPU too. The
interpreter's own plan, :data:`FAT_PROGRAMS` (few programs, as wide as the
work: the interpreter costs milliseconds per program and loop step, so it is
several times faster), is there for speed and is chosen by name:
``PAGED_SPEC_LAUNCH_TARGET=interpreter``.

>>> launch_target(torch.device("cpu")).name
'sm_90, 132 SMs (H200)'
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from spec.errors import InvalidRequestError


@dataclass(frozen=True)
class LaunchTarget:
    """A GPU's shape as a plan sees it, or the interpreter's own (``num_sms`` None)."""

    name: str
    num_sms: int | None  # streaming multiprocessors to fill; None: the interpreter's own plan

    @property
    def gpu(self) -> bool:
        """Whether plans are a GPU's: tensor-core tiles, and splits that fill its SMs."""
        return self.num_sms is not None


H200 = LaunchTarget("sm_90, 132 SMs (H200)", 132)
"""The default target under the interpreter: the GPU this project measures on."""
FAT_PROGRAMS = LaunchTarget("the interpreter's own plan (few fat programs)", None)
"""Fastest under the interpreter; never what a GPU runs."""
TARGET_ENV = "PAGED_SPEC_LAUNCH_TARGET"
"""Under the interpreter: ``h200`` (the default) or ``interpreter``."""
TARGETS = {"h200": H200, "interpreter": FAT_PROGRAMS}


def launch_target(device: torch.device) -> LaunchTarget:
    """The target plans for ``device`` are made for: the CUDA device itself, or under the
    interpreter the one :data:`TARGET_ENV` names."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_target(index)
    name = os.environ.get(TARGET_ENV, "h200").strip().lower()
    if name not in TARGETS:
        raise InvalidRequestError(f"{TARGET_ENV}={name!r}: expected one of {sorted(TARGETS)}")
    return TARGETS[name]


@functools.cache
def _cuda_target(index: int) -> LaunchTarget:
    props = torch.cuda.get_device_properties(index)
    sms = int(props.multi_processor_count)
    return LaunchTarget(f"{props.name}, {sms} SMs", sms)
