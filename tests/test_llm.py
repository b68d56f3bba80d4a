"""Language models: text data from local files, causal_lm from config or a local directory,
and LoRA courses whose exchanged state is the adapters only."""
import json
import math

import numpy as np
import pytest
import torch

from tests.conftest import skip_module_without

skip_module_without("llm", "transformers", "peft")

from fedcore.runtime.course import Course  # noqa: E402
from fedcore.kernel.errors import ConfigError  # noqa: E402
from fedcore.scenarios.data import build_federated_data  # noqa: E402
from fedcore.scenarios.llm_data import ByteTokenizer, token_windows  # noqa: E402
from tests.conftest import small_cfg  # noqa: E402

# a one-layer GPT-2-style decoder, hidden 16, LoRA rank 4 on c_attn (16 -> 48)
HIDDEN, RANK = 16, 4
TINY_LM = {"data.type": "synthetic_text", "data.partition": "natural",
           "data.synthetic_text.authors": 2, "data.synthetic_text.documents": 12,
           "data.text.seq_len": 16, "federate.client_num": 2, "eval.clients": False,
           "model.type": "causal_lm", "model.causal_lm.layers": 1, "model.causal_lm.heads": 2,
           "model.causal_lm.hidden": HIDDEN, "model.causal_lm.max_positions": 32,
           "model.lora.r": RANK, "train.local_steps": 4, "train.batch_size": 8,
           "train.optimizer.type": "adamw", "train.optimizer.lr": 0.02}


def lm_cfg(tmp_path=None, **keys):
    return small_cfg(tmp_path, **{k.replace(".", "__"): v for k, v in {**TINY_LM, **keys}.items()})


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_byte_windows_predict_the_next_token_within_each_group():
    tok = ByteTokenizer()
    x, y, groups, names = token_windows(["abcdef", "xyz", "hello"], ["g1", "g2", "g1"], tok, 4, 4)
    first = [256, *b"abcdef", 257, 256, *b"hello", 257]      # g1's documents joined
    assert names == ["g1", "g2"]
    assert x[0].tolist() == first[:4] and y[0].tolist() == first[1:5]
    assert torch.equal(x[:, 1:], y[:, :-1])                   # y is x shifted by one token
    # g2 has 5 tokens: one window of 4 + its next token; no window mixes groups
    assert groups.tolist() == [0, 0, 0, 1] and x[3].tolist() == [256, *b"xyz"]


def _write_corpus(tmp_path):
    rows = [{"text": f"{author} writes line {i}.", "author": author} for author in ("ann", "bob", "cy")
            for i in range(20)]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "a.txt").write_text("\n".join(f"first file {i}" for i in range(30)))
    (tmp_path / "b.txt").write_text("\n".join(f"second file {i}" for i in range(30)))
    return jsonl


def test_text_files_split_by_a_field_by_file_and_by_dirichlet_over_a_field(tmp_path):
    jsonl = _write_corpus(tmp_path)
    by_author = build_federated_data(lm_cfg(**{"data.type": "text_files", "data.text.files": [str(jsonl)],
                                               "data.text.group_by": "author", "federate.client_num": 3,
                                               "data.splits": [1.0, 0.0, 0.0]}))
    for cid, author in zip((1, 2, 3), ("ann", "bob", "cy")):
        text = bytes(t for t in by_author.clients[cid].train.x.flatten().tolist() if t < 256).decode()
        assert author in text and all(o not in text for o in {"ann", "bob", "cy"} - {author})
    by_file = build_federated_data(lm_cfg(**{"data.type": "text_files", "data.splits": [1.0, 0.0, 0.0],
                                             "data.text.files": [str(tmp_path / "a.txt"),
                                                                 str(tmp_path / "b.txt")]}))
    decoded = [bytes(t for t in by_file.clients[c].train.x.flatten().tolist() if t < 256).decode()
               for c in (1, 2)]
    assert "first file" in decoded[0] and "second" not in decoded[0] and "second file" in decoded[1]
    mixed = build_federated_data(lm_cfg(**{"data.type": "text_files", "data.text.files": [str(jsonl)],
                                           "data.text.group_by": "author", "data.partition": "dirichlet_groups",
                                           "data.alpha": 100.0, "data.min_size": 1}))
    # with a large alpha each author's windows are spread over both clients
    for c in (1, 2):
        x = mixed.clients[c].train.x
        text = bytes(t for t in x.flatten().tolist() if t < 256).decode()
        assert sum(a in text for a in ("ann", "bob", "cy")) >= 2


def test_parquet_documents_load_through_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "docs.parquet"
    datasets.Dataset.from_dict({"body": [f"doc number {i}" for i in range(40)],
                                "task": ["qa", "chat"] * 20}).to_parquet(str(path))
    data = build_federated_data(lm_cfg(**{"data.type": "text_files", "data.text.files": [str(path)],
                                          "data.text.field": "body", "data.text.group_by": "task"}))
    assert len(data.clients) == 2 and all(len(c.train) > 0 for c in data.clients.values())


def test_a_json_array_of_rows_reads_like_json_lines_and_empty_or_broken_files_are_one_line(tmp_path):
    rows = [{"body": f"doc number {i}", "task": ["qa", "chat"][i % 2]} for i in range(40)]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    keys = {"data.type": "text_files", "data.text.field": "body", "data.text.group_by": "task"}
    a, b = (build_federated_data(lm_cfg(**keys, **{"data.text.files": [str(tmp_path / f)]}))
            for f in ("rows.jsonl", "rows.json"))
    assert all(torch.equal(a.clients[c].train.x, b.clients[c].train.x) for c in a.clients)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "partial.jsonl").write_text(json.dumps(rows[0]) + "\n" + json.dumps({"body": "x"}))
    for name, message in (("empty.jsonl", "hold no documents"), ("partial.jsonl", "row 2 of .* no field 'task'")):
        with pytest.raises(ConfigError, match=message):
            build_federated_data(lm_cfg(**keys, **{"data.text.files": [str(tmp_path / name)]}))


@pytest.mark.parametrize("keys, message", [
    ({"data.type": "text_files", "data.text.files": ["/nonexistent/x.jsonl"]}, "does not exist"),
    ({"model.path": "/nonexistent/model"}, "does not exist"),
    ({"data.text.tokenizer": "/"}, "holds no tokenizer"),
    ({"model.type": "logreg"}, "logreg reads float features, but data.type synthetic_text gives windows"),
    ({"model.lora.r": HIDDEN + 1}, f"{HIDDEN + 1} exceeds the rank of the adapted layer .*c_attn "
                                   f"\\({HIDDEN} -> {3 * HIDDEN}\\)"),
    ({"model.causal_lm.hidden": 15}, "not a multiple"),
    ({"model.lora.ranks": [2, 5]}, "must be ranks from 1"),
    ({"algorithm.name": "diloco", "train.preserve_optimizer_state": True},
     "needs model.lora.aggregation=separate"),
    ({"server_optimizer.type": "adam"}, "server_optimizer.type=adam needs model.lora.aggregation=separate"),
])
def test_bad_language_model_settings_are_one_line(keys, message):
    with pytest.raises(ConfigError, match=message) as info:
        Course(lm_cfg(**keys)).build()
    assert "\n" not in str(info.value)


def test_a_saved_model_too_short_for_the_windows_or_not_causal_is_refused_in_one_line(tmp_path):
    transformers = pytest.importorskip("transformers")
    short = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=300, n_layer=1, n_head=2,
                                                                 n_embd=8, n_positions=12))
    short.save_pretrained(str(tmp_path / "short"))
    encoder = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=300, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=64))
    encoder.save_pretrained(str(tmp_path / "encoder"))
    cases = [({"model.path": str(tmp_path / "short")}, "data.text.seq_len: 16 exceeds the 12 positions"),
             ({"model.path": str(tmp_path / "encoder"), "model.lora.target_modules": ["query", "value"]},
              "is not causal: its outputs at a position depend on later tokens")]
    for keys, message in cases:
        with pytest.raises(ConfigError, match=message) as info:
            Course(lm_cfg(**keys)).build()
        assert "\n" not in str(info.value)
    # the same short model reads windows that fit it (and a decoder passes the causality check)
    Course(lm_cfg(**{"model.path": str(tmp_path / "short"), "data.text.seq_len": 12})).build()


def test_lora_course_trains_and_exchanges_only_the_adapters(tmp_path):
    course = Course(lm_cfg(tmp_path, **{"federate.total_round_num": 3})).build()
    base = {n: p.detach().clone() for n, p in course.trainer.model.named_parameters() if not p.requires_grad}
    summary = course.run()
    import transformers
    from fedcore.wire.serialization import encoded_size
    # rank r on c_attn (in h, out 3h): A is r x h, B is 3h x r
    adapter = RANK * HIDDEN + 3 * HIDDEN * RANK
    final = torch.load(tmp_path / "final_model.pt", weights_only=True)
    assert sorted(final) == ["lm.base_model.model.transformer.h.0.attn.c_attn.lora_A.default.weight",
                             "lm.base_model.model.transformer.h.0.attn.c_attn.lora_B.default.weight"]
    assert sum(t.numel() for t in final.values()) == adapter == summary["trainable_params"]
    plain = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=259, n_layer=1, n_head=2, n_embd=HIDDEN, n_positions=32))
    assert summary["total_params"] == sum(p.numel() for p in plain.parameters()) + adapter
    # the base did not move; every update is the adapters (4 bytes a value) plus the framing:
    # per tensor its name and a few bytes of tags, lengths, dtype and shape; per message a header
    for n, p in course.trainer.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base[n]), n
    update = {"model": final, "num_samples": 1}
    framing = encoded_size(update) - 4 * adapter
    assert 0 < framing < sum(len(k) + 40 for k in final) + 100
    for r in _records(tmp_path):
        assert 2 * 4 * adapter < r["bytes_up"] < 2 * (4 * adapter + framing + 200)
        assert r["bytes_up"] < 4 * summary["total_params"] / 4   # far below one whole model
    perplexity = [r["test_perplexity"] for r in _records(tmp_path)]
    assert perplexity[-1] < perplexity[0] < 259 * 1.5 and all(np.isfinite(perplexity))
    assert _records(tmp_path)[-1]["test_loss"] == pytest.approx(np.log(perplexity[-1]))


def _own_rank_course(**extra):
    """A course of clients of ranks 1 and 3 (r = 4) whose server records, each round, the
    adapters it broadcast and the updates it aggregated (decoded, as the aggregation sees them)."""
    course = Course(lm_cfg(**{"model.lora.ranks": [1, 3], "federate.total_round_num": 2, **extra})).build()
    seen = []
    aggregator = course.server.aggregator
    inner = aggregator.aggregate

    def spy(updates, round_):
        seen.append(({k: v.clone() for k, v in aggregator.global_state.items()},
                     [{k: v.clone() for k, v in u.content["model"].items()} for u in updates]))
        return inner(updates, round_)

    aggregator.aggregate = spy
    course.run()
    (a_name, b_name), = [(k, k.replace("lora_A", "lora_B")) for k in seen[0][1][0] if "lora_A" in k]
    return course, seen, a_name, b_name


def _weighted_mean_of_cut_products(course, updates, a_name, b_name):
    """sum_i w_i B_i[:, :r_i] A_i[:r_i] / sum_i w_i over clients 1 (rank 1) and 2 (rank 3), in float64."""
    weights = [len(course.data.clients[c].train) for c in (1, 2)]
    total = sum(w * (u[b_name].double()[:, :k] @ u[a_name].double()[:k])
                for u, w, k in zip(updates, weights, (1, 3)))
    return total / sum(weights)


def _global_product(course, a_name, b_name):
    state = course.server.aggregator.global_state
    return state[b_name].double() @ state[a_name].double()


def test_clients_of_their_own_rank_and_the_exact_aggregate_of_a_course(tmp_path):
    course, seen, a_name, b_name = _own_rank_course()
    broadcast, updates = seen[-1]
    for update, rank in zip(updates, (1, 3)):          # client 1 trains rank 1, client 2 rank 3
        # beyond its rank a client changes nothing: it sends back what it received there
        assert torch.equal(update[a_name][rank:], broadcast[a_name][rank:])
        assert torch.equal(update[b_name][:, rank:], broadcast[b_name][:, rank:])
        assert not torch.equal(update[a_name][:rank], broadcast[a_name][:rank])
        assert not torch.equal(update[b_name][:, :rank], broadcast[b_name][:, :rank])
    assert broadcast[a_name][1:].any()   # round 2's broadcast has components beyond rank 1
    # 1 + 3 <= r = 4: the global B A is the sample-weighted mean of the clients' rank-r_i products
    expected = _weighted_mean_of_cut_products(course, updates, a_name, b_name)
    assert (_global_product(course, a_name, b_name) - expected).abs().max() < 1e-6


@pytest.mark.parametrize("extra", [
    {"compress.type": "int8"}, {"compress.type": "topk", "compress.topk_fraction": 0.1},
    {"privacy.dp.mode": "local", "privacy.dp.noise_multiplier": 0.1, "privacy.dp.clip_norm": 1.0},
], ids=["int8", "topk", "local_dp"])
def test_own_ranks_stay_exact_under_compression_and_local_dp(extra):
    """Whatever the encoding or the noise puts beyond a client's rank is not read: the global
    B A is still the weighted mean of the clients' products cut to their ranks, as decoded."""
    course, seen, a_name, b_name = _own_rank_course(**extra)
    broadcast, updates = seen[-1]
    moved = max(float((u[a_name][k:] - broadcast[a_name][k:]).abs().max()) for u, k in zip(updates, (1, 3)))
    expected = _weighted_mean_of_cut_products(course, updates, a_name, b_name)
    assert (_global_product(course, a_name, b_name) - expected).abs().max() < 1e-6
    if extra.get("compress.type") == "topk":
        assert moved == 0.0    # a zero change beyond the rank: top-k never picks it
    if "privacy.dp.mode" in extra:
        assert moved > 0.0     # the noise lands there too, and is ignored


def test_a_model_from_a_local_directory_and_a_local_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    words = ["<bos>", "<eos>", "<unk>"] + sorted({w for a in range(3) for w in
                                                  f"author{a} the cat a dog sees eats".split()})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)},
                                                           unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>",
                                                eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(str(tmp_path / "tok"))
    lm = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=len(words), n_layer=1, n_head=2,
                                                              n_embd=8, n_positions=32))
    lm.save_pretrained(str(tmp_path / "model"))
    course = Course(lm_cfg(**{"model.path": str(tmp_path / "model"), "data.text.seq_len": 8,
                              "data.text.tokenizer": str(tmp_path / "tok"),
                              "federate.total_round_num": 1})).build()
    assert course.data.num_classes == len(words)
    assert int(course.data.clients[1].train.x.max()) < len(words)
    loaded = dict(course.trainer.model.named_parameters())
    wte = loaded["lm.base_model.model.transformer.wte.weight"]
    assert torch.equal(wte, lm.transformer.wte.weight)       # the saved weights, not new ones
    course.run()


def test_the_gpu_benchmark_without_a_gpu_exits_2_with_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run")
    from bench.llm_lora import main
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no GPU" in err


@pytest.mark.parametrize("keys", [
    {"algorithm.name": "fedprox"},                                           # exact aggregation
    {"privacy.dp.mode": "local", "privacy.dp.noise_multiplier": 0.5, "privacy.dp.clip_norm": 0.5},
    {"server_optimizer.type": "adam", "server_optimizer.lr": 0.01, "model.lora.aggregation": "separate"},
])
def test_algorithms_on_adapters_move_the_adapters_only(tmp_path, keys):
    course = Course(lm_cfg(tmp_path, **{**keys, "federate.total_round_num": 2})).build()
    frozen = {n: p.detach().clone() for n, p in course.trainer.model.named_parameters() if not p.requires_grad}
    start = {k: v.clone() for k, v in course.server.aggregator.global_state.items()}
    summary = course.run()
    if "privacy.dp.mode" in keys:   # the accountant saw both clients' updates
        assert summary["dp_noisy_clients"] == 2 and summary["dp_epsilon"] > 0
    final = torch.load(tmp_path / "final_model.pt", weights_only=True)
    assert final.keys() == start.keys() and all("lora_" in k for k in final)
    assert any(not torch.equal(final[k], start[k]) for k in final)
    for n, p in course.trainer.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[n]), n
    assert np.isfinite(_records(tmp_path)[-1]["test_perplexity"])


def test_unreadable_local_model_and_tokenizer_directories_are_one_line(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "gpt2", "n_layer": "two"}')
    (tmp_path / "tok").mkdir()
    for keys, message in (({"model.path": str(tmp_path / "model")}, "model.path: cannot load"),
                          ({"data.text.tokenizer": str(tmp_path / "tok")}, "data.text.tokenizer: .* holds no tokenizer")):
        with pytest.raises(ConfigError, match=message) as info:
            Course(lm_cfg(**keys)).build()
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("arch, targets", [("gpt2", ["c_attn"]), ("llama", ["q_proj", "v_proj"])])
def test_a_lora_course_trains_vectorized_and_equals_its_sequential_run(arch, targets):
    """The adapters of a round's clients are stacked over one shared frozen base (and, for
    Llama, its rotary embedding's frequencies, a non-persistent buffer): every fit runs
    batched, and the course ends where the sequential one does."""
    keys = {"model.causal_lm.arch": arch, "model.lora.target_modules": targets,
            "train.optimizer.type": "sgd", "train.optimizer.lr": 0.1,
            "federate.total_round_num": 2, "model.lora.aggregation": "separate"}
    finals, summaries = [], []
    for executor in ("sequential", "vectorized"):
        course = Course(lm_cfg(executor=executor, **keys)).build()
        summaries.append(course.run())
        finals.append({k: v.detach().clone() for k, v in course.server.aggregator.global_state.items()})
    # 4 steps of 8 windows a round. Round 1: both clients take 8, 8, 8, 8 from the start (they
    # hold 44 and 37 windows): one group. Round 2 they are at window 32: 8, 4 | 8, 8 for the
    # first, 5 | 8, 8, 8 for the second; batches of other sizes cannot be stacked, so each
    # trains alone
    assert sorted(len(c.train) for c in course.data.clients.values()) == [37, 44]
    assert summaries[1]["batched_fits"] == 2 and summaries[1]["sequential_fits"] == 2
    assert summaries[0]["batched_fits"] == 0 and summaries[0]["sequential_fits"] == 4
    assert finals[0].keys() == finals[1].keys() and len(finals[0]) == 2 * len(targets)
    assert max(float((finals[0][k] - finals[1][k]).abs().max()) for k in finals[0]) < 1e-6
    first = Course(lm_cfg(**keys)).build()   # the adapters really moved from where they began
    start = first.server.aggregator.global_state
    assert max(float((finals[0][k] - start[k]).abs().max()) for k in start) > 1e-4


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_attention_dropout_keeps_a_course_sequential_and_says_so_before_round_1(arch, caplog):
    """Attention dropout is drawn inside the attention function, which the vectorized engine
    cannot replay: the course is known to train one client at a time before it starts."""
    import logging
    keys = {"model.causal_lm.arch": arch, "model.causal_lm.dropout": 0.1, "train.optimizer.type": "sgd",
            "federate.total_round_num": 1, "model.lora.aggregation": "separate"}
    with caplog.at_level(logging.WARNING, logger="fedcore.executor"):
        course = Course(lm_cfg(executor="vectorized", **keys)).build()
        assert "drops out inside the attention function" in caplog.text
        summary = course.run()
    assert summary["batched_fits"] == 0 and summary["sequential_fits"] == 2
    assert "failed" not in caplog.text   # decided, not a fallback after a failure


def test_full_fine_tuning_exchanges_a_tied_head_once():
    """GPT-2's output head is its input embedding: one tensor under two names. Without adapters
    every weight is exchanged, and that tensor crosses the wire, and is averaged, once."""
    course = Course(lm_cfg(**{"model.lora.r": 0, "federate.total_round_num": 1})).build()
    model = course.trainer.model
    names = dict(model.named_parameters(remove_duplicate=False))
    assert names["lm.lm_head.weight"] is names["lm.transformer.wte.weight"]
    state = model.state_dict()
    assert "lm.transformer.wte.weight" in state and "lm.lm_head.weight" not in state
    values = sum(t.numel() for t in state.values() if t.is_floating_point())
    unique = sum(p.numel() for p in model.parameters())      # each tensor once
    assert values == unique + sum(b.numel() for b in model.buffers() if b.is_floating_point()
                                   and any(b is t for t in state.values()))
    summary = course.run()
    clients = len(course.data.clients)
    assert 4 * values * clients < summary["bytes_up"] < 4 * values * clients * 1.05
    assert torch.equal(model.lm.lm_head.weight, model.lm.transformer.wte.weight)   # still tied
    # the server's module views the global tensors (assigned, not copied): the head follows
    served = course.server.model.lm
    assert served.lm_head.weight is served.transformer.wte.weight
    assert served.transformer.wte.weight.data_ptr() == \
        course.server.aggregator.global_state["lm.transformer.wte.weight"].data_ptr()
    model.load_state_dict(course.server.aggregator.global_state)   # strict, without the alias


def test_client_evaluation_reports_each_clients_perplexity():
    course = Course(lm_cfg(**{"eval.clients": True, "federate.total_round_num": 1})).build()
    course.run()
    record = course.monitor.records[-1]
    # each client's perplexity is exp of its own mean token loss: exp is convex, so the mean of
    # the perplexities is at least exp of the mean loss (Jensen), and equal only if all agree
    assert record["client_evals"] == 2
    assert record["client_test_perplexity_mean"] >= math.exp(record["client_test_loss_mean"]) * (1 - 1e-12)
    assert record["client_test_perplexity_p10"] == pytest.approx(math.exp(record["client_test_loss_p10"]), rel=1e-9)


def test_a_group_too_short_for_one_window_is_named(caplog):
    import logging
    with caplog.at_level(logging.WARNING, logger="fedcore.data"):
        x, _, groups, names = token_windows(["abcdefghij", "xy", "hello world"], ["g1", "zed", "g1"],
                                            ByteTokenizer(), 4, 4)
    # g1: [BOS] abcdefghij [EOS] [BOS] hello world [EOS] = 26 tokens, windows of 5 every 4: 6
    assert x.shape == (6, 4) and set(groups.tolist()) == {names.index("g1")}
    assert "1 group(s) hold no more than data.text.seq_len (4) tokens, so no window and no client: zed" \
        in caplog.text


def _distinct_values(*models) -> int:
    """Values held in memory by `models` together: each storage once."""
    seen = {}
    for m in models:
        for p in m.parameters():
            seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes() // p.element_size()
    return sum(seen.values())


@pytest.mark.parametrize("r", [RANK, 0])
def test_a_course_holds_a_frozen_base_once_and_adapters_per_model(r):
    """The trainer trains in a copy of the server's model: with adapters the copy shares the
    frozen base and owns its adapters; without them (every weight trained) it owns everything."""
    import copy
    course = Course(lm_cfg(**{"model.lora.r": r})).build()
    server, trainer = course.server.model, course.trainer.model
    trainable, total = server.parameter_counts()
    expected = total + trainable if r else 2 * total     # one base, an adapter set per model
    assert _distinct_values(server, trainer) == expected
    third = copy.deepcopy(trainer)                       # and so for any further copy
    assert _distinct_values(server, trainer, third) == expected + (trainable if r else total)
    course.run()
    state = server.state_dict()
    assert state.keys() == trainer.state_dict().keys()
    moved = dict(trainer.named_parameters())
    for n, p in server.named_parameters():
        assert (p is moved[n]) == (r > 0 and not p.requires_grad), n
