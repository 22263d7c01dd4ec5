"""ForwardCostModel: recovers a non-linear cost curve, follows changes, ignores hiccups."""

from __future__ import annotations

import json
import random

import pytest

from adaserve.request_manager.control.cost_model import ForwardCostModel, bucket_of

SLOPE = 2e-6  # seconds per context token


def g_cpu(n: int) -> float:
    """The measured CPU shape: 1 token cheap, 2-4 tokens dearer than 5-16."""
    if n == 1:
        return 0.070
    if n <= 4:
        return 0.130
    return 0.110


def sample(model: ForwardCostModel, rng: random.Random, n: int, g=g_cpu, slope=SLOPE) -> None:
    """n noisy (+-3%) forwards of 1..16 tokens over 100..8000 context tokens."""
    for _ in range(n):
        tokens = rng.randint(1, 16)
        context = rng.randint(100, 8000)
        true = g(tokens) + slope * context
        model.observe(tokens, context, true * rng.uniform(0.97, 1.03))


def test_bucketing():
    assert [bucket_of(n) for n in (1, 2, 31, 32, 33, 40, 64, 65, 200)] == [
        1,
        2,
        31,
        32,
        64,
        64,
        64,
        128,
        256,
    ], "buckets are not exact to 32 then next power of two"


def test_recovers_a_non_monotonic_cost_curve():
    model = ForwardCostModel()
    sample(model, random.Random(0), 3000)
    for tokens in (1, 2, 3, 4, 5, 8, 16):
        for context in (500, 4000):
            want = g_cpu(tokens) + SLOPE * context
            got = model.predict(tokens, context)
            assert got == pytest.approx(want, rel=0.04), (
                f"T({tokens}, {context}) = {got * 1e3:.1f} ms, true {want * 1e3:.1f} ms"
            )
    slope = model.coefficients()["slope_s_per_token"]
    assert slope == pytest.approx(SLOPE, rel=0.15), f"slope {slope:.2e}, true {SLOPE:.2e}"
    assert model.num_observations == 3000 and model.num_rejected == 0, "clean samples rejected"


def test_prefill_chunks_do_not_teach_decode_forwards_their_context_cost():
    """Attention work is query-key pairs: a 256-token chunk over c cached tokens does 256 c
    of them, a decode forward over c context tokens c. A slope shared by both priced decode
    iterations over long contexts at seconds."""
    pair_s = 2e-6
    model = ForwardCostModel()
    rng = random.Random(6)
    for _ in range(600):
        sample(model, rng, 1, slope=pair_s)  # decode-like: 1-16 tokens, 100-8000 context
        cached = rng.randint(0, 2000)  # a prefill chunk over its request's cached tokens
        model.observe(256, cached, (0.5 + 256 * pair_s * cached) * rng.uniform(0.97, 1.03))
    for tokens, context in ((8, 16000), (16, 30000), (4, 500)):
        want = g_cpu(tokens) + pair_s * context
        got = model.predict(tokens, context)
        assert got == pytest.approx(want, rel=0.1), (
            f"T({tokens}, {context}) = {got * 1e3:.0f} ms, true {want * 1e3:.0f} ms"
        )
    want = 0.5 + 256 * pair_s * 1500
    assert model.predict(256, 1500) == pytest.approx(want, rel=0.05), "chunk cost lost"


def test_a_forward_over_a_short_context_never_costs_nothing():
    """Big forwards seen only over long contexts, whose cost grows faster than linearly: a
    straight line through them crosses zero before context 0. The intercept is held at 0."""
    true = lambda c: 0.1 + 1e-11 * c**3  # noqa: E731
    model = ForwardCostModel()
    rng = random.Random(7)
    for _ in range(300):
        c = rng.randint(2000, 4000)
        model.observe(512, c, true(c) * rng.uniform(0.98, 1.02))
    assert model.coefficients()["g_s"][512] >= 0.0
    assert model.predict(512, 100) > 0.01, "a 512-token forward priced at nothing"
    assert model.predict(512, 3000) == pytest.approx(true(3000), rel=0.25)


def test_follows_a_change_in_cost():
    model = ForwardCostModel()
    rng = random.Random(1)
    sample(model, rng, 2000)
    before = model.predict(3, 1000)

    def g_new(n: int) -> float:
        return 0.5 * g_cpu(n) + 0.02

    sample(model, rng, 3000, g=g_new, slope=SLOPE / 2)
    after = model.predict(3, 1000)
    want = g_new(3) + SLOPE / 2 * 1000
    assert after == pytest.approx(want, rel=0.05), (
        f"after the change T(3, 1000) = {after * 1e3:.1f} ms, true {want * 1e3:.1f} ms "
        f"(before {before * 1e3:.1f} ms)"
    )


def test_outliers_are_rejected_but_a_lasting_change_is_learned():
    model = ForwardCostModel()
    for _ in range(10):
        model.observe(4, 0, 0.130)
    assert model.observe(4, 0, 2.0) is False, "a 15x hiccup was accepted"
    assert model.predict(4, 0) == pytest.approx(0.130, rel=1e-6), "the hiccup moved the model"
    assert model.num_rejected == 1, "rejection not counted"
    # The cost really went to 0.5 s: after a few rejections the model accepts and converges.
    for _ in range(200):
        model.observe(4, 0, 0.5)
    assert model.predict(4, 0) == pytest.approx(0.5, rel=0.02), (
        "a lasting 4x change was not learned"
    )


def test_best_padded_pads_three_tokens_past_the_expensive_range():
    model = ForwardCostModel()
    sample(model, random.Random(2), 3000)
    m = model.best_padded(3, 1000, max_tokens=8)
    assert 5 <= m <= 8, f"best_padded(3) = {m}: should pad into the cheaper 5..16 range"
    assert model.predict(m, 1000) < model.predict(3, 1000), "padded forward is not faster"
    assert model.best_padded(1, 1000, max_tokens=8) == 1, "padded one token although it is cheapest"

    exact = ForwardCostModel.from_coefficients(
        {1: 0.07, 2: 0.13, 3: 0.13, 5: 0.12, 8: 0.10, 16: 0.10}, 0.0
    )
    assert exact.best_padded(3, 0, max_tokens=16) == 8, "did not pick 8 (ties -> smallest)"
    assert exact.best_padded(3, 0, max_tokens=5) == 5, "ignored max_tokens or bucket 5"
    assert exact.best_padded(3, 0, max_tokens=2) == 3, "padded beyond max_tokens"


def test_seeds_hold_for_unobserved_buckets_and_interpolation_fills_gaps():
    model = ForwardCostModel()
    model.seed([(1, 0, 0.07), (4, 0, 0.13), (16, 0, 0.11), (64, 0, 0.20)])
    rng = random.Random(3)
    for _ in range(300):  # only 1-token forwards observed, at a new cost
        model.observe(1, 0, 0.09 * rng.uniform(0.98, 1.02))
    assert model.predict(1, 0) == pytest.approx(0.09, rel=0.02), (
        "observations did not override seed"
    )
    assert model.predict(4, 0) == pytest.approx(0.13), "seeded, unobserved bucket drifted"
    # Neither seeded nor observed: linear in n between known buckets.
    assert model.predict(10, 0) == pytest.approx(0.13 + (0.11 - 0.13) * 6 / 12), (
        "10 not interpolated"
    )
    g32 = 0.11 + 0.09 * 16 / 48
    assert model.predict(40, 0) == pytest.approx(g32 + (0.20 - g32) * 8 / 32), (
        "40 tokens not interpolated between the 32 and 64 buckets"
    )
    assert model.predict(32, 0) == pytest.approx(0.11 + 0.09 * 16 / 48), "32 not interpolated"
    # Beyond the largest known bucket: last segment's slope.
    assert model.predict(128, 0) == pytest.approx(0.20 + 0.09 / 48 * 64), "128 not extrapolated"
    falling = ForwardCostModel.from_coefficients({1: 0.1, 8: 0.05}, 0.0)
    assert falling.predict(64, 0) == pytest.approx(0.05), "extrapolated with a negative slope"


def test_a_flat_last_segment_does_not_make_long_prompts_cheap():
    """The start-up profile of the default server on a 2-core machine (2026-11-27): 24 ms at 1
    token, 355 ms at 32, 376 ms at 64 (one noisy measurement). Extrapolated by the last segment
    alone, a 1,124-token prompt cost 1.1 s, where llama.cpp took ~7.5 ms a token (8.4 s), and
    admission let it in on a first-token objective it missed by 26 s. Beyond the largest
    knot the rise is at least the mean from the first knot (the time is convex in tokens)."""
    points = {1: 0.0241, 2: 0.0323, 4: 0.0556, 8: 0.0986, 16: 0.1622, 32: 0.3554, 64: 0.3759}
    model = ForwardCostModel.from_coefficients(points, 0.0)
    mean = (0.3759 - 0.0241) / 63
    assert model.predict(1024, 0) == pytest.approx(0.3759 + mean * 960)
    assert model.predict(1024, 0) > 5.0, "a 1,024-token prompt priced like a few decode steps"
    # where the last segment is the steeper one (a GPU past its ridge), it still decides
    gpu = ForwardCostModel.from_coefficients({1: 0.008, 64: 0.0085, 128: 0.0095, 256: 0.014}, 0.0)
    assert gpu.predict(512, 0) == pytest.approx(0.014 + (0.0045 / 128) * 256)


def test_forwards_between_two_buckets_do_not_drag_the_upper_bucket_down():
    """A 45-token forward is priced between g(32) and g(64); observing it must not be taken
    for a 64-token forward (chunked prefill sends such sizes every iteration)."""
    true = lambda n: 0.02 + 0.001 * n  # noqa: E731
    model = ForwardCostModel()
    model.seed([(n, 0, true(n)) for n in (1, 2, 4, 8, 16, 32, 64)])
    rng = random.Random(5)
    for _ in range(200):
        n = rng.randint(33, 63)
        model.observe(n, 0, true(n) * rng.uniform(0.99, 1.01))
    for n in (33, 41, 45, 63, 64):
        assert model.predict(n, 0) == pytest.approx(true(n), rel=0.03), f"{n} tokens mispriced"


def test_a_mispriced_lower_bucket_does_not_blow_up_the_upper_one():
    """A 300-token forward is priced between buckets 256 and 512 (f = 0.17); its implied
    512-token cost divides by f, so an error in bucket 256 is amplified six-fold. It stays
    between the sample's own time and k / tokens of it."""
    model = ForwardCostModel()
    model.seed([(256, 0, 0.05)])  # ten times too cheap
    for _ in range(50):
        model.observe(300, 0, 0.6)
    assert 0.6 <= model.predict(512, 0) <= 0.6 * 512 / 300 + 1e-9


def test_prompt_tokens_are_priced_apart_from_decode_tokens():
    """A forward carrying a prompt chunk returns logits for its decode rows only (the LM head
    rows it skips save b each: 8% of a 20-token forward of the default model on ggml), and
    each chunk token attends its whole prompt so far (e per query-key pair), where context
    counts the prompt once. Bucket 20 sees both kinds of forward; each must be priced as it
    is."""
    row_s, pair_s = 0.0006, 4e-8
    model, rng = ForwardCostModel(), random.Random(11)

    def true(decode: int, chunk: int, cached: int, each: int) -> tuple[int, int, int, float]:
        n, context = decode + chunk, decode * each + cached
        pairs = chunk * cached + chunk * (chunk + 1) // 2
        return n, context, pairs, g_cpu(n) + SLOPE * context - row_s * chunk + pair_s * pairs

    for _ in range(1500):
        decode, each = rng.randint(1, 8), rng.randint(100, 800)
        chunk = rng.choice((0, rng.randint(1, 24)))
        cached = rng.randint(0, 3000) if chunk else 0
        n, context, pairs, t = true(decode, chunk, cached, each)
        model.observe(n, context, t * rng.uniform(0.99, 1.01), chunk, pairs)
    coef = model.coefficients()
    assert coef["silent_row_s"] == pytest.approx(row_s, rel=0.15), "b, seconds per silent row"
    assert coef["silent_pair_s"] == pytest.approx(pair_s, rel=0.15), "e, seconds per pair"
    for decode, chunk, cached in ((4, 16, 0), (4, 16, 2500), (20, 0, 0), (2, 14, 1000)):
        n, context, pairs, want = true(decode, chunk, cached, 400)
        got = model.predict(n, context, chunk, pairs)
        assert got == pytest.approx(want, rel=0.03), (
            f"{decode} decode + {chunk} prompt tokens {cached} in: {got * 1e3:.1f} ms, "
            f"true {want * 1e3:.1f}"
        )
    again = ForwardCostModel.from_json(model.to_json())
    assert again.predict(20, 3000, 16, 40000) == pytest.approx(
        model.predict(20, 3000, 16, 40000), rel=0.02
    )
    # A model stored before b and e existed prices silent tokens like any other.
    old = json.loads(model.to_json())
    del old["silent_row_s"], old["silent_pair_s"]
    older = ForwardCostModel.from_json(json.dumps(old))
    assert older.predict(20, 3000, 16, 40000) == older.predict(20, 3000)
    with pytest.raises(ValueError, match="silent tokens"):
        model.predict(4, 0, 5)


def test_tree_pairs_and_prompt_pairs_are_priced_apart():
    """On llama.cpp a tree node's query-key pair costs about twice a prompt-chunk token's
    (~2.6 us against ~1.3 us here): one shared coefficient fitted on both overprices big
    chunks and underprices deep trees. A server verifying trees next to prompt chunks learns
    both, and a 512-token prompt alone is priced as its chunks taught, not as the trees."""
    chunk_pair_s, tree_pair_s = 1.3e-6, 2.6e-6
    model, rng = ForwardCostModel(), random.Random(5)

    def g(n: int) -> float:
        return 0.010 + 0.0035 * n

    def true(n: int, context: int, silent: int, pairs: int, tree: int) -> float:
        return g(n) + SLOPE * context + chunk_pair_s * pairs + tree_pair_s * tree

    for _ in range(2000):
        kind = rng.choice(("decode", "tree", "chunk", "prompt"))
        if kind == "decode":  # one row per request
            n = rng.randint(1, 8)
            shape = (n, n * rng.randint(100, 1500), 0, 0, 0)
        elif kind == "tree":  # one request's root and k nodes, p tokens in
            k, p = rng.randint(1, 4), rng.randint(100, 1500)
            shape = (1 + k, p, 0, 0, k * (p + 2))
        elif kind == "chunk":  # a decode row with a chunk of m tokens, c tokens in
            m, c = rng.randint(1, 24), rng.randint(0, 1500)
            shape = (1 + m, 500 + c, m, m * c + m * (m + 1) // 2, 0)
        else:  # a whole prompt alone
            m = rng.choice((64, 128, 256, 512))
            shape = (m, 0, m - 1, m * (m + 1) // 2, 0)
        n, context, silent, pairs, tree = shape
        t = true(*shape) * rng.uniform(0.98, 1.02)
        model.observe(n, context, t, silent, pairs, tree)
    coef = model.coefficients()
    assert coef["silent_pair_s"] == pytest.approx(chunk_pair_s, rel=0.15), "e, per chunk pair"
    assert coef["tree_pair_s"] == pytest.approx(tree_pair_s, rel=0.15), "h, per tree pair"
    prompt = 512 * 513 // 2
    want = true(512, 0, 511, prompt, 0)
    got = model.predict(512, 0, 511, prompt)
    assert got == pytest.approx(want, rel=0.05), f"a 512-token prompt: {got:.3f} s, true {want:.3f}"
    deep = 3 * 1402  # three nodes past the root, 1,400 tokens in
    assert model.predict(4, 1400, 0, 0, deep) == pytest.approx(true(4, 1400, 0, 0, deep), rel=0.05)
    again = ForwardCostModel.from_json(model.to_json())
    assert again.predict(4, 1400, 0, 0, deep) == pytest.approx(
        model.predict(4, 1400, 0, 0, deep), rel=0.02
    ), "h lost in the JSON round trip"


def test_a_measured_tree_pair_price_prices_deep_trees_before_any_is_verified():
    """The start-up curve's tokens attend short contexts: seeded from it alone, a 12-node tree
    700 tokens into one request was priced as 12 of the curve's tokens (0.67x of its time on
    llama.cpp). With h's measured prior it is priced with its pairs from the first iteration,
    and observed trees that cost otherwise still move h."""
    curve = [(n, 64 * min(n, 8), 0.005 + 0.0025 * n) for n in (1, 2, 4, 8, 12, 16)]
    model = ForwardCostModel()
    model.seed(curve)
    deep = sum(700 + d + 1 for d in range(1, 12))  # the nodes past the root
    blind = model.predict(12, 700, 0, 0, deep)
    model.set_tree_pair_prior(1.5e-6)
    assert model.predict(12, 700, 0, 0, deep) == pytest.approx(blind + 1.5e-6 * deep)
    assert model.predict(12, 700) == pytest.approx(blind), "no tree pairs, no change"
    with pytest.raises(ValueError, match="tree pair must be >= 0"):
        model.set_tree_pair_prior(-1e-6)
    # Trees that cost 3 us a pair, over contexts and sizes that tell pairs from context.
    rng = random.Random(3)
    for _ in range(600):
        k, p = rng.randint(1, 11), rng.randint(100, 1500)
        tree = sum(p + d + 1 for d in range(1, k + 1))
        model.observe(1 + k, p, 0.005 + 0.0025 * (1 + k) + 1e-6 * p + 3e-6 * tree, 0, 0, tree)
        n = rng.randint(1, 8)
        context = n * rng.randint(100, 1500)
        model.observe(n, context, 0.005 + 0.0025 * n + 1e-6 * context)
    assert model.coefficients()["tree_pair_s"] == pytest.approx(3e-6, rel=0.15)


def test_silent_tokens_never_take_more_than_half_a_forward():
    # Few mixed forwards can fit a b too steep for a big chunk: it stays a real cost.
    model = ForwardCostModel.from_coefficients({1: 0.01, 256: 0.05}, 0.0, silent_row_s=0.001)
    assert model.predict(256, 0, 255) == pytest.approx(0.025)
    assert model.predict(256, 0, 10) == pytest.approx(0.04)


def test_json_round_trip():
    model = ForwardCostModel()
    sample(model, random.Random(4), 1000)
    text = model.to_json()
    again = ForwardCostModel.from_json(text)
    for tokens in (1, 3, 7, 16, 20, 100):
        for context in (0, 3000):
            assert again.predict(tokens, context) == pytest.approx(
                model.predict(tokens, context), rel=1e-9
            ), f"round trip changed T({tokens}, {context})"
    assert again.coefficients()["g_s"].keys() == model.coefficients()["g_s"].keys(), "buckets lost"


def test_measures_how_far_forwards_stray_from_its_prediction():
    # A simulator of this server draws forward-time noise from what the server measured.
    model = ForwardCostModel()
    rng = random.Random(5)
    for _ in range(3000):
        tokens, context = rng.randint(1, 16), rng.randint(100, 8000)
        model.observe(
            tokens, context, (g_cpu(tokens) + SLOPE * context) * rng.lognormvariate(0, 0.1)
        )
    n, mean, sigma = model.prediction_error()
    assert n > 2900, "every forward after its bucket's first few is scored"
    assert sigma == pytest.approx(0.1, abs=0.02), f"measured sigma {sigma:.3f} for a true 0.1"
    assert abs(mean) < 0.03, f"biased: mean log error {mean:.3f}"
    quantiles = dict(model.error_quantiles())
    assert quantiles[0.5] == pytest.approx(0.0, abs=0.02), "typical forward: as predicted"
    assert quantiles[0.975] == pytest.approx(0.196, abs=0.04), "the tail of a 0.1 log-normal"
    stored = json.loads(model.to_json())["log_error"]
    assert stored["forwards"] == n and stored["sigma"] == pytest.approx(sigma)
    assert [tuple(x) for x in stored["quantiles"]] == model.error_quantiles()
    ForwardCostModel.from_json(model.to_json())  # readers of the coefficients still load it
    assert ForwardCostModel().prediction_error() == (0, 0.0, 0.0)
    assert "log_error" not in json.loads(ForwardCostModel().to_json()), "nothing measured"


def test_rejects_bad_samples():
    model = ForwardCostModel()
    with pytest.raises(ValueError, match="tokens"):
        model.observe(0, 10, 0.1)
    with pytest.raises(ValueError, match="seconds"):
        model.observe(1, 10, float("nan"))
    with pytest.raises(ValueError, match="context"):
        model.predict(1, -1)


def _ggml_like(noisy: dict[int, float]) -> ForwardCostModel:
    """Decode forwards at 5 ms a row over 6 ms of fixed cost, each bucket seen 20 times, with
    `noisy` buckets fitted at other times (as buckets seen over other contexts come out)."""
    model = ForwardCostModel()
    for n in range(1, 17):
        seconds = noisy.get(n, 6 + 5 * n) / 1000
        for _ in range(20):
            model.observe(n, 800, seconds)
    return model


def test_the_token_slope_is_the_trend_of_the_neighbouring_buckets():
    clean = _ggml_like({})
    assert clean.token_slope(11, 12, 800) == pytest.approx(0.005, rel=1e-6)
    # 12 tokens fitted a little cheaper than 11: the difference says a token costs nothing,
    # the neighbourhood says ~5 ms.
    noisy = _ggml_like({11: 62.0, 12: 60.0})
    assert noisy.predict(12, 800) < noisy.predict(11, 800)
    assert noisy.token_slope(11, 12, 800) == pytest.approx(0.005, rel=0.2)
    # Where the cost is flat, so is the slope (and it is never negative).
    flat = ForwardCostModel()
    for n in (1, 2, 4, 8):
        flat.observe(n, 0, 0.004 - 0.0001 * n)
    assert flat.token_slope(2, 4, 0) == 0.0
    assert ForwardCostModel().token_slope(4, 5, 0) == 0.0, "no data: no floor"


def test_no_token_slope_floor_beyond_the_exact_buckets():
    """From 32 roots on, forwards are priced between power-of-two knots (linear, no noisy
    neighbours): the exact buckets, seen only over short contexts, must not price a tree node
    there. Their context slopes differ (a decode bucket's fit is noisy), and extrapolated to a
    big batch's context they once put a node at 1 ms where the knots said 0.15 ms."""
    model = ForwardCostModel()
    for n in range(1, 33):
        for c in (100, 400):  # exact buckets over short contexts, slopes that differ by bucket
            model.observe(n, c, (20 + 0.3 * n + (0.01 if n % 2 else 0.05) * c / 100) / 1000)
    for n, ms in ((64, 40.0), (128, 48.0), (256, 66.0)):
        for c in (8000, 20000):
            model.observe(n, c, (ms + c / 2000) / 1000)
    assert model.token_slope(52, 104, 17000) == 0.0
    spread = model.predict(104, 17000) - model.predict(52, 17000)
    assert spread / 52 < 0.0005, "the knots' own price of a token here"


def test_best_padded_prices_only_known_buckets_and_finds_the_cheapest_size():
    # Between known buckets a prediction is linear in the size, so the knots and the largest
    # size allowed are the only candidates: the same choice as pricing every bucket size.
    rng = random.Random(11)
    for _ in range(200):
        model = ForwardCostModel()
        knots = rng.sample([1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 64, 128, 256], rng.randint(1, 8))
        model.seed([(k, rng.randint(0, 4000), rng.uniform(0.002, 0.2)) for k in knots])
        tokens, context = rng.randint(1, 40), rng.randint(0, 5000)
        limit = rng.choice([tokens, tokens + 3, 16, 32, 48, 256])
        sizes = [m for m in range(tokens + 1, limit + 1) if bucket_of(m) == m]
        brute = min(
            [model.predict(tokens, context)]
            + [model.predict(m, context, m - tokens) for m in sizes]
        )
        best = model.best_padded(tokens, context, limit)
        assert tokens <= best <= max(tokens, limit)
        assert model.predict(best, context, best - tokens) == pytest.approx(brute, rel=1e-9)


@pytest.mark.parametrize("seed", range(5))
def test_the_fit_kept_between_decode_samples_equals_a_fit_from_scratch(seed):
    """The pooled (b, e, h) fit is kept while only decode-only buckets see samples (every
    iteration of plain decoding refits): predictions must equal a fit of the same samples
    from scratch, whatever the mix of decode rows, prompt chunks and trees."""
    import copy

    rng = random.Random(seed)
    model = ForwardCostModel.from_coefficients({1: 0.01, 8: 0.02}, 1e-6, tree_pair_s=1e-8)
    for _ in range(300):
        tokens = rng.choice([1, 2, 3, 4, 8, 16, 40, 64])
        kind = rng.random()
        silent = rng.randint(1, tokens) if kind < 0.15 and tokens > 1 else 0
        pairs = silent * rng.randint(100, 3000) if silent else 0
        tree = rng.randint(1, 5000) if 0.15 <= kind < 0.3 and tokens > 1 else 0
        context = rng.randint(0, 4000)
        seconds = 0.01 + 0.001 * tokens + 1e-6 * context - 1e-4 * silent + 1e-8 * tree
        model.observe(tokens, context, seconds * rng.uniform(0.95, 1.05), silent, pairs, tree)
        if rng.random() < 0.3:
            fresh = copy.deepcopy(model)
            fresh._residuals.clear()
            fresh._shared_fit = None
            fresh._dirty = True
            for n, c, s, q, t in [(1, 500, 0, 0, 0), (5, 2000, 0, 0, 300), (40, 100, 30, 9000, 0)]:
                assert model.predict(n, c, s, q, t) == fresh.predict(n, c, s, q, t)
