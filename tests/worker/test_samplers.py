"""worker/samplers.py: each sampler a job may name is built from the model's own scheduler config."""

from __future__ import annotations

from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, EulerAncestralDiscreteScheduler

from shared.contract.models import FAMILY_SPECS, SCHEDULERS
from worker.samplers import BUILDERS, Samplers
from worker.stepping import STEPPABLE, STEPPABLE_CLASSES


def model_scheduler() -> DDIMScheduler:
    # An SD-like noise schedule that differs from the classes' defaults, so that carrying it over shows.
    return DDIMScheduler(num_train_timesteps=500, beta_start=0.001, beta_end=0.02,
                         beta_schedule="scaled_linear")


def test_the_worker_builds_every_sampler_the_contract_offers() -> None:
    assert set(BUILDERS) == set(SCHEDULERS)


def test_a_sampler_keeps_the_models_noise_schedule_and_is_made_once() -> None:
    samplers = Samplers(model_scheduler())
    assert samplers.get(None) is samplers.default
    karras = samplers.get("dpmpp_2m_karras")
    assert isinstance(karras, DPMSolverMultistepScheduler) and karras.config.use_karras_sigmas
    assert not samplers.get("dpmpp_2m").config.use_karras_sigmas
    for name in SCHEDULERS:
        built = samplers.get(name)
        assert built is samplers.get(name)  # no new object per job
        assert (built.config.num_train_timesteps, built.config.beta_start, built.config.beta_schedule) == \
            (500, 0.001, "scaled_linear"), name
    assert isinstance(samplers.get("euler_a"), EulerAncestralDiscreteScheduler)


def test_each_familys_samplers_are_built_and_its_steppable_ones_are_the_loops() -> None:
    samplers = Samplers(model_scheduler())
    for family, spec in FAMILY_SPECS.items():
        assert spec.samplers and set(spec.samplers) <= set(BUILDERS), family
        assert STEPPABLE[family] == spec.steppable
        assert all(isinstance(samplers.get(name), STEPPABLE_CLASSES) for name in spec.steppable), family
