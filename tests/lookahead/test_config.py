import re

import pytest

from trt_lookahead.lookahead.config import MAX_STEP_TOKENS, LookaheadConfig

C = LookaheadConfig


@pytest.mark.parametrize("text", ["4,3,4", "4/3/4", "[4,3,4]", " [4, 3, 4] ", "4 3 4"])
def test_parse_forms(text):
    assert LookaheadConfig.parse(text) == LookaheadConfig(4, 3, 4)


@pytest.mark.parametrize("text", ["4,3", "a,b,c", "4,3,4,1", "", "[4;3;4]", "4.0,3,4"])
def test_parse_rejects_malformed(text):
    with pytest.raises(ValueError, match="W,N,G"):
        LookaheadConfig.parse(text)


@pytest.mark.parametrize(
    ("args", "name"), [((0, 3, 4), "W"), ((4, 1, 4), "N"), ((4, 3, -1), "G"), ((4, 3, True), "G"), ((4.0, 3, 4), "W")]
)
def test_impossible_configs_name_the_parameter(args, name):
    with pytest.raises(ValueError, match=f"{name}"):
        LookaheadConfig(*args)


def test_parse_of_negative_value_is_a_clear_error():
    with pytest.raises(ValueError, match="G=-1 is impossible"):
        LookaheadConfig.parse("4,3,-1")


@pytest.mark.parametrize(
    ("cfg", "T"),
    [((4, 3, 4), 16), ((7, 5, 7), 56), ((15, 5, 15), 120), ((5, 4, 2), 21), ((1, 2, 0), 1), ((3, 2, 0), 3)],
)
def test_tokens_per_step(cfg, T):
    assert LookaheadConfig(*cfg).step_tokens == T


def trtllm_max_decoding_tokens(W: int, N: int, G: int) -> int:
    """TensorRT-LLM's `maxDecodingTokens` (golden token + maxDraftTokens = (N-2) + (W-1+G)(N-1))."""
    return 1 + (N - 2) + (W - 1 + G) * (N - 1)


def test_derived_sizes_and_trtllm_equivalents():
    cfg = LookaheadConfig(7, 7, 7)
    assert cfg.levels == 6 and cfg.max_accepted_per_step == 7
    # TensorRT-LLM: maxDraftTokens = 83 here, max_draft_len in its lookahead README; its decoding tokens are our T
    assert trtllm_max_decoding_tokens(7, 7, 7) - 1 == 83
    assert trtllm_max_decoding_tokens(7, 7, 7) == 84 == cfg.step_tokens
    assert LookaheadConfig.greedy().is_greedy and not cfg.is_greedy


def test_fits_engine():
    engine = LookaheadConfig(7, 5, 7)
    LookaheadConfig(4, 3, 4).check_fits(engine)
    LookaheadConfig(7, 5, 7).check_fits(engine)
    LookaheadConfig.greedy().check_fits(engine)
    with pytest.raises(ValueError, match=r"W=15 > 7.*G=15 > 7"):
        LookaheadConfig(15, 5, 15).check_fits(engine)
    with pytest.raises(ValueError, match="N=6 > 5"):
        LookaheadConfig(4, 6, 4).check_fits(engine)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ((100000, 100000, 100000), "T = (W+G)(N-1) = 19999800000"),  # issue 10: a numpy OOM traceback before
        ((300, 30, 300), "= 17400 tokens, above the limit of 1024"),  # issue 10: a 19 GB build before
        ((1025, 2, 0), "above the limit of 1024"),
        ((1, 1026, 0), "above the limit of 1024"),
    ],
)
def test_step_size_is_bounded_with_the_limit_in_the_message(args, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        LookaheadConfig(*args)
    with pytest.raises(ValueError, match=re.escape(words)):
        LookaheadConfig.parse(",".join(str(v) for v in args))


def test_the_largest_step_is_allowed():
    assert LookaheadConfig(512, 3, 0).step_tokens == MAX_STEP_TOKENS
    assert LookaheadConfig(1, 1025, 0).step_tokens == MAX_STEP_TOKENS


@pytest.mark.parametrize("text", ["٤,3,4", "4,３,4", "1" * 40 + ",3,4"])
def test_parse_takes_short_ascii_numbers_only(text):
    with pytest.raises(ValueError, match="W,N,G"):
        LookaheadConfig.parse(text)


@pytest.mark.parametrize("columns, N, most, expected", [
    # the window gets 1.2 sqrt(W + G) columns, rounded: the best splits measured at T = 28, 56, 120 (docs/design.md 9)
    (7, 5, None, C(3, 5, 4)),  # 1.2 x 2.65 = 3.17
    (14, 5, None, C(4, 5, 10)),  # 1.2 x 3.74 = 4.49
    (30, 5, None, C(7, 5, 23)),  # 1.2 x 5.48 = 6.57
    (16, 3, None, C(5, 3, 11)),  # 4.8
    (4, 3, None, C(2, 3, 2)),  # 2.4
    (2, 4, None, C(1, 4, 1)),  # 1.70 rounds to 2, but the tree keeps a column
    (1, 3, None, C(1, 3, 0)),  # no column left for the tree
    (16, 5, C(8, 5, 8), C(8, 5, 8)),  # G capped at 8, its 3 columns back to the window
    (12, 5, C(2, 5, 4), C(2, 5, 4)),  # both capped: fewer columns than asked
    (16, 5, C(20, 5, 3), C(13, 5, 3)),
])
def test_split_gives_the_window_the_square_root_of_the_columns(columns, N, most, expected):
    assert C.split(columns, N, most) == expected


def test_cover_is_the_largest_of_each_size():
    cover = C.cover([C(4, 3, 4), C(8, 5, 8), C(15, 2, 1)])
    assert cover == C(15, 5, 8)
    for config in (C(4, 3, 4), C(8, 5, 8), C(15, 2, 1)):
        config.check_fits(cover)  # raises where a size is larger than the cover's
    with pytest.raises(ValueError, match="G=9 > 8"):
        C(1, 2, 9).check_fits(cover)
