"""The text_embedding adapter: batching across requests, slicing by max_batch, and failure
isolation, with a fake model and a fake outbox (no torch, no processes)."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.messages import Embed, Embeddings, Error
from modelpool.protocol.pipes import WorkItem
from modelpool.workers.capabilities import text_embedding, text_limits

DIM = 3


def _row(text: str) -> list[float]:
    """The fake model's vector for a text: distinct per text, exact in float32."""
    code = sum(ord(c) for c in text)
    return [float(len(text)), code / 4.0, -float(code % 7)]


class FakeEmbedder:
    """Embeds with _row (as float64, to check the adapter converts); records call sizes."""

    def __init__(self, poison: str | None = None, drop_rows: int = 0) -> None:
        self.calls: list[list[str]] = []
        self.poison = poison
        self.drop_rows = drop_rows

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        self.calls.append(list(texts))
        if self.poison is not None and self.poison in texts:
            raise ValueError(f"cannot embed {self.poison!r}")
        rows = [_row(t) for t in texts]
        return np.array(rows[: len(rows) - self.drop_rows], dtype=np.float64).reshape(-1, DIM)

    def info(self) -> dict[str, int]:
        return {"dim": DIM}


class FakeOutbox:
    def __init__(self) -> None:
        self.sent: list[msgspec.Struct] = []
        self.ticks = 0

    def send(self, msg: msgspec.Struct) -> None:
        self.sent.append(msg)

    def tick(self) -> None:
        self.ticks += 1

    def aborted(self, job_id: int) -> bool:
        return False


def _items(*texts: list[str]) -> list[WorkItem]:
    return [WorkItem(job_id=100 + i, request=Embed(id=i, texts=t)) for i, t in enumerate(texts)]


def _expected(item: WorkItem) -> Embeddings:
    assert isinstance(item.request, Embed)
    rows = np.array([_row(t) for t in item.request.texts], dtype=np.float32)
    return Embeddings(id=item.job_id, data=rows.tobytes(), shape=[len(rows), DIM])


def _decode(msg: Embeddings) -> np.ndarray:
    return np.frombuffer(msg.data, dtype=np.float32).reshape(msg.shape)


def test_rows_are_split_per_item() -> None:
    items = _items(["alpha", "beta"], ["gamma"], ["delta", "epsilon", "zeta"])
    model, out = FakeEmbedder(), FakeOutbox()
    text_embedding.run(model, items, out, 32)
    assert model.calls == [["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]]
    assert out.sent == [_expected(item) for item in items]
    first = out.sent[0]
    assert isinstance(first, Embeddings) and first.dtype == "float32"
    np.testing.assert_array_equal(_decode(first), [_row("alpha"), _row("beta")])
    assert out.ticks == 1


class CountingEmbedder(FakeEmbedder):
    """Reads each text as one token per word, and says so with its vectors."""

    def embed_counted(self, texts: Sequence[str]) -> tuple[np.ndarray, list[int]]:
        return self.embed(texts), [len(t.split()) for t in texts]


def test_each_reply_counts_the_tokens_of_its_own_texts() -> None:
    items = _items(["one two", "three"], ["four five six"])
    out = FakeOutbox()
    text_embedding.run(CountingEmbedder(), items, out, 32)
    assert [m.tokens for m in out.sent] == [3, 3]  # type: ignore[attr-defined]
    out = FakeOutbox()  # a model that cannot count: zeros, and the request still runs
    text_embedding.run(FakeEmbedder(), items, out, 32)
    assert out.sent == [_expected(item) for item in items]
    assert [m.tokens for m in out.sent] == [0, 0]  # type: ignore[attr-defined]


def test_inputs_over_max_batch_are_embedded_in_slices() -> None:
    items = _items([f"a{i}" for i in range(5)], [f"b{i}" for i in range(3)])
    model, out = FakeEmbedder(), FakeOutbox()
    text_embedding.run(model, items, out, 3)
    assert [len(call) for call in model.calls] == [3, 3, 2]
    assert [t for call in model.calls for t in call] == [*items[0].request.texts,
                                                         *items[1].request.texts]
    assert out.ticks == 3  # one per forward pass
    # The slice boundary (after a2, after b0) must not leak into the per-item split.
    assert out.sent == [_expected(item) for item in items]


def test_max_batch_of_one() -> None:
    items = _items(["x", "y"])
    model, out = FakeEmbedder(), FakeOutbox()
    text_embedding.run(model, items, out, 1)
    assert model.calls == [["x"], ["y"]]
    assert out.sent == [_expected(items[0])]


def test_a_poison_input_fails_only_its_own_request() -> None:
    items = _items(["fine", "also fine"], ["ok", "poison"], ["last one"])
    model, out = FakeEmbedder(poison="poison"), FakeOutbox()
    text_embedding.run(model, items, out, 32)
    by_id = {m.id: m for m in out.sent}  # type: ignore[attr-defined]
    assert len(out.sent) == 3 and set(by_id) == {100, 101, 102}
    assert by_id[100] == _expected(items[0])
    assert by_id[102] == _expected(items[2])
    error = by_id[101]
    assert isinstance(error, Error)
    assert error.code == ErrorCode.MODEL_ERROR
    assert "poison" in error.message


def test_a_single_failing_request_gets_an_error() -> None:
    out = FakeOutbox()
    text_embedding.run(FakeEmbedder(poison="poison"), _items(["poison"]), out, 32)
    assert len(out.sent) == 1
    error = out.sent[0]
    assert isinstance(error, Error) and error.id == 100 and error.code == ErrorCode.MODEL_ERROR


def test_wrong_number_of_rows_is_an_error() -> None:
    out = FakeOutbox()
    text_embedding.run(FakeEmbedder(drop_rows=1), _items(["a", "b"]), out, 32)
    assert len(out.sent) == 1
    error = out.sent[0]
    assert isinstance(error, Error) and error.code == ErrorCode.MODEL_ERROR
    assert "2 texts" in error.message


def test_wrong_rows_in_a_batch_fail_every_request_once() -> None:
    out = FakeOutbox()
    text_embedding.run(FakeEmbedder(drop_rows=1), _items(["a"], ["b", "c"]), out, 32)
    assert sorted(m.id for m in out.sent) == [100, 101]  # type: ignore[attr-defined]
    assert all(isinstance(m, Error) and m.code == ErrorCode.MODEL_ERROR for m in out.sent)


class LimitedEmbedder(FakeEmbedder):
    def info(self) -> dict[str, int]:
        return {"dim": DIM, "max_seq_length": 4}


def test_texts_are_cut_to_what_the_model_can_see_before_tokenizing() -> None:
    limit = 4 * text_limits.MAX_CHARS_PER_TOKEN
    model, out = LimitedEmbedder(), FakeOutbox()
    text_embedding.run(model, _items(["x" * 8_000_000, "short"]), out, 32)
    assert sorted(len(t) for call in model.calls for t in call) == [5, limit]
    assert isinstance(out.sent[0], Embeddings)


def test_a_model_that_states_no_limit_gets_texts_whole() -> None:
    model, out = FakeEmbedder(), FakeOutbox()
    text_embedding.run(model, _items(["x" * 100_000]), out, 32)
    assert len(model.calls[0][0]) == 100_000


def test_passes_group_texts_of_similar_lengths_and_replies_keep_their_order() -> None:
    short, long = [f"s{i}" for i in range(6)], [f"{'l' * 300}{i}" for i in range(6)]
    mixed = [text for pair in zip(short, long, strict=True) for text in pair]
    items = _items(mixed[:5], mixed[5:])
    model, out = FakeEmbedder(), FakeOutbox()
    text_embedding.run(model, items, out, 32)
    # Padding each short text to 300 characters costs more than a second pass.
    assert model.calls == [short, long]
    assert out.ticks == 2
    assert out.sent == [_expected(item) for item in items]


def test_pass_groups_weigh_padding_against_the_cost_of_a_pass() -> None:
    groups = text_embedding.pass_groups
    assert groups([10] * 5, 2, 100) == [[0, 1], [2, 3], [4]]  # equal: full passes first
    assert groups([5, 500, 6, 7], 32, 100) == [[0, 2, 3], [1]]
    assert groups([5, 500, 6, 7], 32, 10_000) == [[0, 1, 2, 3]]  # passes cost too much
    assert groups([5, 500, 6, 7], 2, 100) == [[0, 2], [3], [1]]
    assert groups([], 32, 100) == []
    assert groups([42], 32, 100) == [[0]]
    lengths = [(i * 37) % 301 for i in range(200)]
    split = groups(lengths, 32, 200)
    assert sorted(i for group in split for i in group) == list(range(200))
    assert all(len(group) <= 32 for group in split)


@given(st.lists(st.integers(0, 400), max_size=70), st.integers(1, 40), st.integers(0, 300))
@example([0, 5], 32, 5)  # a tie: one pass of padding 5, or two passes of none
def test_inputs_of_near_equal_lengths_go_in_the_one_pass_the_shortest_path_picks(
        lengths: list[int], max_batch: int, pass_cost: int) -> None:
    """Skipping the search when all the padding costs less than one pass more (most
    batches of short texts) changes nothing: the search picks the same passes."""
    near = [n % 7 for n in lengths]  # padding within 6 a text: often under pass_cost
    for inputs in (lengths, near):
        assert text_embedding.pass_groups(inputs, max_batch, pass_cost) == \
            text_embedding.shortest_passes(inputs, max_batch, pass_cost)


def test_slices_also_follow_a_cost_budget() -> None:
    out = FakeOutbox()
    calls: list[list[int]] = []

    def embed(chunk: Sequence[int]) -> np.ndarray:
        calls.append(list(chunk))
        return np.zeros((len(chunk), 1))

    text_embedding.in_slices(embed, [5, 5, 5, 20, 1, 1], out, 4, "images",
                             cost=lambda n: n, budget=10)
    assert calls == [[5, 5], [5], [20], [1, 1]]  # an input over budget goes alone


class MatryoshkaFake(FakeEmbedder):
    """Unit-length rows (or the raw ones) that may be shortened to `sizes` ([]: any)."""

    def __init__(self, sizes: list[int], unit: bool = True) -> None:
        super().__init__()
        self.matryoshka_dimensions = sizes
        self.unit = unit

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        rows = super().embed(texts)
        return rows / np.linalg.norm(rows, axis=1, keepdims=True) if self.unit else rows


def _asking(dimensions: list[int | None]) -> list[WorkItem]:
    return [WorkItem(job_id=100 + i, request=Embed(id=i, texts=["some text", "more"],
                                                   dimensions=d))
            for i, d in enumerate(dimensions)]


def test_dimensions_shorten_each_request_in_the_one_pass_and_renormalise() -> None:
    model, out = MatryoshkaFake([]), FakeOutbox()
    text_embedding.run(model, _asking([2, None, 1, 4]), out, 32)
    assert len(model.calls) == 1  # every request's texts in one forward pass
    full = model.embed(["some text", "more"])
    by_id = {m.id: m for m in out.sent}  # type: ignore[attr-defined]
    two, whole, one = (_decode(by_id[i]) for i in (100, 101, 102))
    np.testing.assert_allclose(whole, full, rtol=1e-6)
    assert two.shape == (2, 2) and one.shape == (2, 1)
    np.testing.assert_allclose(two, full[:, :2] / np.linalg.norm(full[:, :2], axis=1,
                                                                  keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(two, axis=1), 1, rtol=1e-6)
    np.testing.assert_allclose(np.abs(one), 1, rtol=1e-6)
    too_many = by_id[103]  # only it fails: its batch mates are answered
    assert isinstance(too_many, Error) and too_many.code == ErrorCode.BAD_REQUEST
    assert too_many.message.startswith("dimensions: 4 is not one") and "1 to 3" in too_many.message


def test_rows_not_of_unit_length_are_cut_as_they_are() -> None:
    model, out = MatryoshkaFake([], unit=False), FakeOutbox()
    text_embedding.run(model, _asking([2]), out, 32)
    np.testing.assert_array_equal(_decode(out.sent[0]),  # type: ignore[arg-type]
                                  model.embed(["some text", "more"])[:, :2].astype(np.float32))


def test_only_the_sizes_a_model_lists_and_only_models_that_list_any() -> None:
    out = FakeOutbox()
    text_embedding.run(MatryoshkaFake([2]), _asking([2, 1]), out, 32)
    assert _decode(out.sent[0]).shape == (2, 2)  # type: ignore[arg-type]
    listed = out.sent[1]
    assert isinstance(listed, Error) and listed.code == ErrorCode.BAD_REQUEST
    assert "(2)" in listed.message
    out = FakeOutbox()
    text_embedding.run(FakeEmbedder(), _asking([None, 2, DIM]), out, 32)
    whole, refused, own_size = out.sent
    assert isinstance(whole, Embeddings) and whole.shape == [2, DIM]
    assert isinstance(refused, Error) and refused.code == ErrorCode.BAD_REQUEST
    assert "Matryoshka" in refused.message and "3 values" in refused.message
    assert own_size == msgspec.structs.replace(whole, id=102)  # asks for nothing: taken
