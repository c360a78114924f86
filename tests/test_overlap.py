"""The GPU overlap/bucketing flags come from parallel.* config; a user's XLA_FLAGS wins."""

from ultrajax.config import parse
from ultrajax.config import schema as config
from ultrajax.train import overlap


def test_flags_follow_config():
    cfg = parse.load(None, ["parallel.overlap=false", "parallel.all_gather_bucket_mib=32"])
    flags = overlap.xla_flags(cfg.parallel)
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in flags
    assert f"--xla_gpu_all_gather_combine_threshold_bytes={32 * 2**20}" in flags
    assert f"--xla_gpu_all_reduce_combine_threshold_bytes={64 * 2**20}" in flags


def test_user_flags_are_kept_and_win():
    env = {"XLA_FLAGS": "--xla_gpu_all_reduce_combine_threshold_bytes=5 --foo=1"}
    out = overlap.apply(parse.load(None).parallel, env).split()
    assert "--xla_gpu_all_reduce_combine_threshold_bytes=5" in out and "--foo=1" in out
    assert sum(f.startswith("--xla_gpu_all_reduce_combine") for f in out) == 1
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in out


def test_negative_bucket_is_a_config_error():
    try:
        parse.load(None, ["parallel.reduce_scatter_bucket_mib=-1"])
    except config.ConfigError as e:
        assert "parallel.reduce_scatter_bucket_mib" in str(e)
    else:
        raise AssertionError("accepted a negative bucket size")


def test_collective_pipelining_follows_config():
    on = overlap.xla_flags(parse.load(None, ["parallel.pipeline_collectives=true"]).parallel)
    off = overlap.xla_flags(parse.load(None).parallel)
    for flag in overlap.PIPELINED:
        assert f"{flag}=true" in on and f"{flag}=false" in off
