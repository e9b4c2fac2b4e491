"""The sampler-vs-learner mismatch rules (rl.mismatch, rl.losses' trust region) against the
float64 numpy reference on a packed batch with known ratios, the levels told apart by hand, the
defaults bitwise unchanged from before the rules existed, and the config's "auto"."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from rl import losses
from rl.learner import MAX_METRICS, rollout_metrics
from rl.losses import LossConfig, grpo_loss, trust_region_keep
from rl.mismatch import behaviour_weights, resolve_correction
from tests.rl import mismatch_golden as golden
from tests.rl import numpy_reference as ref

TOL = dict(rtol=1e-5, atol=1e-6)

# Sequences of a packed batch, each its tokens' ratios old/sampler (the known ratios), and
# pi / pi_old and pi_old for the trust region. Token ratios in [mis_low, mis_high] = [0.5, 2]
# or not, products and geometric means chosen so that the three levels disagree:
#   a: [3.0, 0.9, 1.1]       product 2.97 (out), geometric 1.437 (in), token: 3.0 out
#   b: [0.6, 0.6, 0.6, 0.6]  product 0.1296 (out), geometric 0.6 (in), token: all in
#   c: [0.2, 1.0]            product 0.2 (out), geometric 0.447 (out), token: 0.2 out
#   d: [1.5, 1.2]            product 1.8 (in), geometric 1.342 (in), token: all in
#   e: [2.5]                 one token: 2.5 out at every level
SEQS = {
    "a": dict(ratio=[3.0, 0.9, 1.1], adv=1.0),
    "b": dict(ratio=[0.6, 0.6, 0.6, 0.6], adv=-0.5),
    "c": dict(ratio=[0.2, 1.0], adv=0.7),
    "d": dict(ratio=[1.5, 1.2], adv=-1.2),
    "e": dict(ratio=[2.5], adv=0.3),
}
# Rows of 8 positions: (sequence, number of non-loss positions before its tokens) packed in order,
# the rest padding; segment ids 1, 2, ... per row.
ROWS = [[("a", 1), ("b", 0)], [("c", 2), ("d", 1)], [("e", 0)]]
T = 8
EXPECTED_KEEP = {  # (level, sequence) -> keep per token under mis / icepop with band [0.5, 2]
    "token": dict(a=[0, 1, 1], b=[1, 1, 1, 1], c=[0, 1], d=[1, 1], e=[0]),
    "sequence": dict(a=[0, 0, 0], b=[0, 0, 0, 0], c=[0, 0], d=[1, 1], e=[0]),
    "geometric": dict(a=[1, 1, 1], b=[1, 1, 1, 1], c=[0, 0], d=[1, 1], e=[0]),
}


def packed():
    """The packed batch of SEQS (f32 [3, 8] arrays, garbage at padding) and per sequence its
    tokens' (row, column)s."""
    rng = np.random.default_rng(11)
    shape = (len(ROWS), T)
    arrays = {k: np.zeros(shape) for k in ("logp", "old", "sampler", "ref", "adv", "ent")}
    segments, mask = np.zeros(shape, np.int32), np.zeros(shape, np.float32)
    where = {}
    for r, row in enumerate(ROWS):
        col = 0
        for s, (name, lead) in enumerate(row, start=1):
            seq = SEQS[name]
            n = len(seq["ratio"])
            segments[r, col : col + lead + n] = s
            cols = list(range(col + lead, col + lead + n))
            mask[r, cols] = 1.0
            where[name] = [(r, c) for c in cols]
            old = np.log(rng.uniform(0.05, 0.95, n))  # pi_old in (0.05, 0.95)
            arrays["old"][r, cols] = old
            arrays["sampler"][r, cols] = old - np.log(seq["ratio"])  # ratio old/sampler exactly
            arrays["logp"][r, cols] = old + rng.normal(0.0, 0.4, n)
            arrays["ref"][r, cols] = old + rng.normal(0.0, 0.3, n)
            arrays["ent"][r, cols] = rng.uniform(0.0, 2.0, n)
            arrays["adv"][r, col : col + lead + n] = seq["adv"]
            col += lead + n
    pad = segments == 0
    for k, junk in [("logp", -np.inf), ("old", 1e4), ("sampler", np.nan), ("ref", np.inf)]:
        arrays[k][pad] = junk
    arrays["ent"][pad] = np.nan
    f32 = {k: np.asarray(v, np.float32) for k, v in arrays.items()}
    return dict(f32, mask=mask, segments=segments), where


BATCH, WHERE = packed()


def sequences(batch=BATCH):
    """The packed batch as the reference's list of sequences (float64 of the f32 values)."""
    pick = lambda key, name: np.array([float(batch[key][rc]) for rc in WHERE[name]], np.float64)
    return [
        dict(
            logp=pick("logp", n),
            old_logp=pick("old", n),
            sampler_logp=pick("sampler", n),
            ref_logp=pick("ref", n),
            entropy=pick("ent", n),
            adv=float(np.float32(SEQS[n]["adv"])),
        )
        for n in SEQS
    ]


def jnp_loss(cfg, batch=BATCH):
    b = {k: jnp.asarray(v) for k, v in batch.items()}
    return grpo_loss(
        b["logp"],
        b["old"],
        b["sampler"],
        b["ref"],
        b["adv"],
        b["mask"],
        cfg,
        global_tokens=jnp.sum(b["mask"]),
        global_seqs=float(len(SEQS)),
        entropy=b["ent"],
        segments=b["segments"],
    )


def per_sequence(x):
    """[3, 8] -> {sequence: its tokens' values}."""
    return {n: [float(x[rc]) for rc in WHERE[n]] for n in SEQS}


def flat(metrics):
    out = {k: float(v) for k, v in metrics.items() if k != "maxima"}
    out.update({k: float(v) for k, v in metrics["maxima"].items()})
    return out


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_masks_and_weights_by_hand(level):
    """mis keeps EXPECTED_KEEP with weight 1; icepop keeps the same with weight = the ratio of
    the level (0 where dropped); tis keeps all with min(ratio, 2)."""
    b = {k: jnp.asarray(BATCH[k]) for k in ("old", "sampler", "mask", "segments")}
    args = (b["old"], b["sampler"], b["mask"])
    ratio_of = {
        "token": lambda r: list(r),
        "sequence": lambda r: [math.prod(r)] * len(r),
        "geometric": lambda r: [math.prod(r) ** (1 / len(r))] * len(r),
    }[level]
    for corr in ("mis", "icepop", "tis"):
        cfg = LossConfig(is_correction=corr, is_level=level)
        w, keep = (
            per_sequence(np.asarray(x)) for x in behaviour_weights(*args, cfg, b["segments"])
        )
        for name, seq in SEQS.items():
            ratios = ratio_of(seq["ratio"])
            want_keep = EXPECTED_KEEP[level][name] if corr != "tis" else [1] * len(ratios)
            want_w = {
                "mis": [1.0] * len(ratios),
                "icepop": [r * k for r, k in zip(ratios, want_keep)],
                "tis": [min(r, 2.0) for r in ratios],
            }[corr]
            assert keep[name] == want_keep, (corr, level, name)
            np.testing.assert_allclose(w[name], want_w, **TOL, err_msg=f"{corr} {level} {name}")


def test_trust_region_by_hand():
    """DPPO's mask: A > 0 drops tokens whose probability rose by more than high, A <= 0 those
    whose probability fell by more than low; 'log' measures the move in log-probability."""
    old = np.log(np.array([[0.5, 0.5, 0.5, 0.5, 0.05, 0.05]], np.float32))
    new = np.log(np.array([[0.75, 0.6, 0.25, 0.4, 0.1, 0.02]], np.float32))
    adv = np.array([[1.0, 1.0, -1.0, -1.0, 1.0, -1.0]], np.float32)
    # tv, low = high = 0.2: moves +0.25 (A>0: out), +0.1 (in), -0.25 (A<0: out), -0.1 (in),
    # +0.05 (in), -0.03 (in). log, 0.5: +0.405 in, +0.18 in, -0.69 out, -0.22 in, +0.69 out, -0.92 out
    # abs_log, 0.3 (|d| > 0.3): 0.405 out, 0.18 in, 0.69 out, 0.22 in, 0.69 out, 0.92 out
    for region, delta, want in [
        ("tv", 0.2, [0, 1, 0, 1, 1, 1]),
        ("log", 0.5, [1, 1, 0, 1, 0, 0]),
        ("abs_log", 0.3, [0, 1, 0, 1, 0, 0]),
    ]:
        cfg = LossConfig(trust_region=region, trust_region_low=delta, trust_region_high=delta)
        got = np.asarray(trust_region_keep(jnp.asarray(new), jnp.asarray(old), adv, cfg))
        np.testing.assert_array_equal(got[0], want, err_msg=region)
    # One side only: with a region of width 0 every token that moved the way its advantage
    # pushes is dropped, and with the advantages reversed none is (they keep the gradient that
    # brings them back), where a two-sided |d| > 0 would drop all six both times.
    cfg = LossConfig(trust_region="tv", trust_region_low=0.0, trust_region_high=0.0)
    for sign, want in [(1, [0] * 6), (-1, [1] * 6)]:
        got = np.asarray(trust_region_keep(jnp.asarray(new), jnp.asarray(old), sign * adv, cfg))
        np.testing.assert_array_equal(got[0], want)
    # Two-sided: the advantage's sign plays no part (with it reversed, 'log' at 0.3 keeps all
    # six, 'abs_log' still drops four), and low and high bound each side.
    for region, low, high, want in [
        ("log", 0.3, 0.3, [1] * 6),
        ("abs_log", 0.3, 0.3, [0, 1, 0, 1, 0, 0]),
        ("abs_log", 0.5, 0.1, [0, 0, 0, 1, 0, 0]),  # d > 0.1 or d < -0.5
    ]:
        cfg = LossConfig(trust_region=region, trust_region_low=low, trust_region_high=high)
        got = np.asarray(trust_region_keep(jnp.asarray(new), jnp.asarray(old), -adv, cfg))
        np.testing.assert_array_equal(got[0], want, err_msg=f"{region} {low} {high}")


RULES = [
    dict(is_correction="mis", is_level="geometric"),
    dict(is_correction="tis", is_level="geometric"),
    dict(is_correction="icepop", is_level="token"),
    dict(is_correction="icepop", is_level="sequence", policy_loss="gspo"),
    dict(is_correction="icepop", is_level="geometric", aggregation="seq_mean_token_mean"),
    dict(is_correction="mis", is_level="token", trust_region="tv"),
    dict(is_correction="none", trust_region="log", trust_region_low=0.3, trust_region_high=0.25),
    dict(
        is_correction="tis",
        trust_region="tv",
        trust_region_low=0.1,
        trust_region_high=0.05,
        aggregation="seq_mean_token_sum",
        policy_loss="cispo",
    ),
    dict(
        is_correction="icepop",
        trust_region="abs_log",
        trust_region_low=0.3,
        trust_region_high=0.5,
        aggregation="seq_mean_token_mean",
    ),
]


@pytest.mark.parametrize("rule", RULES, ids=lambda d: "-".join(map(str, d.values())))
def test_rule_matches_numpy_on_packed_batch(rule):
    """Loss, gradient-free metrics (masked fractions of tokens and sequences, the mismatch KL and
    max |diff|) against the float64 reference, and the same over an uneven split of the rows
    (contributions summed, maxima maxed)."""
    cfg = LossConfig(**{"kl_coef": 0.04, "entropy_coef": 0.01, "max_new_tokens": 8, **rule})
    loss, metrics = jnp_loss(cfg)
    want = ref.grpo_loss_seqs(sequences(), cfg)
    got = flat(metrics)
    assert set(got) == set(want)
    np.testing.assert_allclose(float(loss), want["loss"], **TOL)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], **TOL, err_msg=k)
    if cfg.trust_region != "none":
        assert 0 < got["trust_masked_frac"] < 1  # the rule is exercised, not vacuous
    if cfg.is_correction in ("mis", "icepop"):
        assert 0 < got["mis_masked_seq_frac"] < 1

    def rows(sl):
        part = {k: v[sl] for k, v in BATCH.items()}
        b = {k: jnp.asarray(v) for k, v in part.items()}
        return grpo_loss(
            b["logp"],
            b["old"],
            b["sampler"],
            b["ref"],
            b["adv"],
            b["mask"],
            cfg,
            global_tokens=float(BATCH["mask"].sum()),
            global_seqs=float(len(SEQS)),
            entropy=b["ent"],
            segments=b["segments"],
        )

    (l1, m1), (l2, m2) = rows(slice(0, 1)), rows(slice(1, 3))
    np.testing.assert_allclose(float(l1) + float(l2), float(loss), **TOL)
    for k, v in flat(losses.combine_metrics(m1, m2)).items():
        np.testing.assert_allclose(v, got[k], **TOL, err_msg=f"split {k}")


def test_mismatch_max_is_a_max():
    """mismatch_abs_logp_max: the largest |old - sampler| over valid tokens (|log 0.2| here),
    reduced with max over row splits, never summed."""
    _, metrics = jnp_loss(LossConfig())
    got = float(metrics["maxima"]["mismatch_abs_logp_max"])
    np.testing.assert_allclose(got, -math.log(0.2), rtol=1e-5)
    assert "mismatch_abs_logp_max" in MAX_METRICS
    history = [
        {"mismatch_abs_logp_max": 1.0, "loss": 2.0},
        {"mismatch_abs_logp_max": 3.0, "loss": 4.0},
    ]
    assert rollout_metrics(history) == {"mismatch_abs_logp_max": 3.0, "loss": 3.0}


def test_defaults_bitwise_unchanged():
    """none / tis / mis at token and sequence level: loss, gradient and every metric that existed
    before the rules equal, bit for bit, what the code before them computed
    (tests/rl/mismatch_golden.py, eager and under jit)."""
    want = np.load(golden.PATH)
    got = golden.all_outputs()
    assert len(want.files) == 113 and set(want.files) <= set(got)
    for k in want.files:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize(
    "given,cache,weights,old_logp,want",
    [
        ("auto", "", "", "recompute", "none"),
        ("auto", "bfloat16", "bfloat16", "recompute", "none"),
        ("auto", "int8", "", "recompute", "tis"),
        ("auto", "", "float8_e4m3fn", "recompute", "tis"),
        ("auto", "int8", "int8", "sampler", "none"),  # pi_old is the sampler: nothing to correct
        ("none", "int8", "", "recompute", "none"),  # turned off (with a warning: test_config)
        ("mis", "", "", "recompute", "mis"),
    ],
)
def test_auto_resolves_from_the_rollout_dtypes(given, cache, weights, old_logp, want):
    assert resolve_correction(given, cache, weights, old_logp) == want


def _config(**rl):
    from configs.default import get_config

    c = get_config()
    for k, v in rl.items():
        section, field = k.split("__")
        c[section][field] = v
    return c


def test_config_auto_warning_and_resume():
    """launch.validate resolves "auto" into the LossConfig, warns in one line when a quantised
    rollout's correction is turned off, and launch.resume_compat resumes a run saved with
    "none" (the default before) or without the trust-region fields under today's defaults."""
    from launch import validate as v
    from launch.cli import config_json
    from launch.resume_compat import check_resumable

    c = _config()
    assert c.rl.is_correction == "auto" and v.loss_config(c).is_correction == "none"
    assert v.mismatch_warning(c) is None
    c = _config(sampling__cache_dtype="int8")  # the name alone decides (the dtypes: issue 53 1-2)
    assert v.is_correction(c) == "tis" and v.mismatch_warning(c) is None
    c = _config(sampling__weights_dtype="float8_e4m3fn", rl__is_correction="none")
    line = v.mismatch_warning(c)
    assert line.startswith("warning: config.rl.is_correction='none' with a quantised rollout")
    assert "sampling.weights_dtype='float8_e4m3fn'" in line and "\n" not in line
    assert (
        v.mismatch_warning(_config(rl__is_correction="tis", sampling__cache_dtype="int8")) is None
    )

    new = config_json(_config())
    saved = config_json(_config(rl__is_correction="none"))
    for f in ("trust_region", "trust_region_low", "trust_region_high"):
        del saved["rl"][f]
    check_resumable(saved, new)  # before the rules: none, no trust region
    with pytest.raises(Exception, match="rl.is_correction: 'tis' -> 'auto'"):
        check_resumable(config_json(_config(rl__is_correction="tis")), new)
    with pytest.raises(Exception, match="rl.trust_region: None -> 'tv'"):
        check_resumable(saved, config_json(_config(rl__trust_region="tv")))


def test_validate_warns_once_and_builds_the_resolved_loss(capsys):
    """A run's start-up (launch.validate.validate, then the learner's config): an int8 rollout
    trains with tis by default, and with is_correction=none says so in one stderr line."""
    from launch.cli import parse_args
    from launch.validate import learner_config, validate

    int8 = ["--config.sampling.weights_dtype=int8"]
    fp8 = ["--config.sampling.cache_dtype=float8_e4m3fn"]
    for args, want, warned in [
        ([], "none", False),
        (["--config.sampling.cache_dtype=int8"], "tis", False),
        ([*int8, "--config.rl.is_correction=none"], "none", True),
        ([*fp8, "--config.rl.is_correction=mis"], "mis", False),
    ]:
        config = parse_args(args, {})[0]
        validate(config, 1)
        assert learner_config(config, (2,)).loss.is_correction == want, args
        err = capsys.readouterr().err.splitlines()
        assert len(err) == int(warned), err
        assert all(e.startswith("warning: config.rl.is_correction='none'") for e in err), err


@pytest.mark.parametrize(
    "bad,field",
    [
        (dict(mis_low=2.5, mis_high=2.0), "mis_low=2.5: must satisfy 0 <= mis_low < mis_high"),
        (dict(mis_low=-0.1), "mis_low"),
        (dict(is_cap=-1.0), "is_cap=-1.0: must be > 0"),
        (dict(is_correction="tis", is_cap=0.5), "is_cap=0.5: must be >= 1 \\(a cap below 1"),
        (
            dict(is_correction="mis", mis_low=1.2, mis_high=2.0),
            "mis_low=1.2: the band \\[mis_low, mis_high\\] must hold 1",
        ),
        (dict(is_correction="icepop", mis_low=0.2, mis_high=0.8), "mis_high=0.8: the band"),
        (dict(trust_region="tv", trust_region_high=1.5), "trust_region_high=1.5: must be < 1 with"),
        (dict(trust_region_low=-0.1), "trust_region_low=-0.1: must be >= 0"),
        (dict(trust_region_high=-1.0), "trust_region_high"),
        (dict(trust_region="dppo"), "trust_region='dppo': must be one of none, tv, log, abs_log"),
        (dict(trust_region="abs_log", trust_region_high=-0.2), "trust_region_high=-0.2: must be"),
        (dict(is_level="geo"), "is_level='geo': must be one of token, sequence, geometric"),
        (dict(is_correction="auto"), "is_correction='auto': must be one of none, tis, mis, icepop"),
    ],
)
def test_bad_values_fail_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=f"^LossConfig.{field}"):
        LossConfig(**bad).validate()


def test_bounds_of_an_unused_rule_are_not_checked():
    """A cap below 1 or a band without 1 is refused only where its rule is in use: a run saved
    with another rule (before these checks) still loads."""
    LossConfig(is_correction="none", is_cap=0.5, mis_low=1.2, mis_high=2.0).validate()
    LossConfig(is_correction="mis", is_cap=0.5).validate()
    LossConfig(is_correction="tis", mis_low=0.2, mis_high=0.8).validate()
