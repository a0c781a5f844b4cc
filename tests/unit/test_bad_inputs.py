"""Bad input to pretrain_gpt.py, table driven: every case ends with its exit code and one line naming
the flag or file at fault, and no traceback.

Flags, data files (missing, corrupt, truncated, foreign dtype, out-of-vocabulary ids, damaged caches)
and output paths. Most cases call ``main()`` in this process (an exception escaping it fails the
test just as a traceback would); a subset runs as real processes. The two torchrun cases (the line appears
once for the whole job) are in tests/distributed/test_launch.py.
"""

import subprocess
import sys

import pytest

import pretrain_gpt
from megalite.checkpointing.run import RunParts
from tests.helpers import REPO
from tests.helpers.bad_inputs import DATA, MOCK, _argv, write_data_dir

# (base, extra flags, exit code, text the one error line must contain). $T is the data directory.
CASES = [
    # -- flags -------------------------------------------------------------------------------------
    (MOCK, "--train-iters -1", 2, "--train-iters must be >= 0"),
    (MOCK, "--log-interval 0", 2, "--log-interval must be > 0"),
    (MOCK, "--make-vocab-size-divisible-by 0", 2, "--make-vocab-size-divisible-by must be > 0"),
    (MOCK, "--hidden-dropout 1.0", 2, "--hidden-dropout must be in [0, 1)"),
    (MOCK, "--attention-dropout -0.1", 2, "--attention-dropout must be in [0, 1)"),
    (MOCK, "--adam-beta1 1.0", 2, "--adam-beta1 must be in [0, 1)"),
    (MOCK, "--adam-beta2 -0.5", 2, "--adam-beta2 must be in [0, 1)"),
    (MOCK, "--num-threads -1", 2, "--num-threads must be > 0"),
    (MOCK, "--position-embedding-type rope --rotary-base 0", 2, "--rotary-base must be > 0"),
    (MOCK, "--ffn-hidden-size 0", 2, "--ffn-hidden-size must be > 0"),
    (MOCK, "--num-query-groups 2", 2, "--num-query-groups needs --group-query-attention"),
    (MOCK, "--min-lr 1 --lr 0.1", 2, "--min-lr 1 is above --lr 0.1"),
    (MOCK, "--lr-warmup-iters -1", 2, "--lr-warmup-iters must be >= 0"),
    (MOCK, "--clip-grad -1", 2, "--clip-grad must be >= 0"),
    (MOCK, "--eval-interval -1", 2, "--eval-interval must be >= 0"),
    (
        MOCK,
        "--eval-interval 0",
        2,
        "--eval-interval 0 with --eval-iters 1: give --eval-interval N > 0 to evaluate "
        "every N iterations (N >= --train-iters: only at the end), or --eval-iters 0 for no evaluation",
    ),
    (MOCK, "--lr -1e-3", 2, "--lr must be > 0, got -0.001"),
    (MOCK, "--lr -1", 2, "--lr must be > 0, got -1"),
    (MOCK, "--lr abc", 2, "argument --lr: invalid float value: 'abc'"),
    (MOCK, "--hidden-size 30", 2, "--hidden-size 30 is not divisible by --num-attention-heads 4"),
    (MOCK, "--tensor-model-parallel-size 3", 2, "world size 1 is not divisible by tensor-model-parallel-size (3)"),
    (MOCK, "--global-batch-size 7", 2, "--global-batch-size 7 is not divisible by --micro-batch-size 2"),
    (MOCK, "--micro-batch-size 0", 2, "--micro-batch-size must be > 0"),
    (MOCK, "--num-layrs 2", 2, "did you mean --num-layers?"),
    (MOCK, "--bf16 --fp16", 2, "--bf16 and --fp16 are exclusive"),
    (MOCK, "--context-parallel-size 2", 2, "--context-parallel-size 2 = 2 ranks, more than the world size 1"),
    (MOCK, "--recompute-granularity full", 2, "--recompute-granularity full needs --recompute-method"),
    (MOCK, "--overlap-param-gather", 2, "--overlap-param-gather needs --use-distributed-optimizer"),
    (MOCK, "--save-interval 10", 2, "--save-interval needs --save DIR"),
    (MOCK, "--num-workers -1", 2, "--num-workers must be >= 0"),
    (MOCK, "--distributed-timeout-minutes 0", 2, "--distributed-timeout-minutes must be > 0"),
    (MOCK, "--exit-duration-in-mins -5", 2, "--exit-duration-in-mins must be > 0"),
    (MOCK, "--exit-interval 0", 2, "--exit-interval must be > 0"),
    (MOCK, "--seed -1", 2, "--seed must be >= 0"),
    (MOCK, "--max-position-embeddings 8", 2, "--seq-length 16 exceeds --max-position-embeddings 8"),
    (MOCK, "--pipeline-schedule interleaved_1f1b", 2, "interleaved_1f1b needs vp > 1"),
    (MOCK, "--position-embedding-type rope --hidden-size 36", 2, "rope needs an even head dim"),
    (MOCK, "--swiglu --openai-gelu", 2, "--openai-gelu selects the GeLU of the plain MLP, but --swiglu uses SiLU"),
    (MOCK, "--ckpt-format foo", 2, "argument --ckpt-format: invalid choice: 'foo'"),
    (MOCK, "--num-layers-per-virtual-pipeline-stage 3", 2, "--num-layers-per-virtual-pipeline-stage 3 must divide"),
    (MOCK, "--data-path $T/good", 2, "--mock-data and --data-path/--train-data-path are exclusive"),
    (MOCK, "--load $T/afile", 2, "--load $T/afile is a file"),
    # -- data files --------------------------------------------------------------------------------
    (DATA, "--data-path $T/missing", 2, "not found: $T/missing.idx"),
    (DATA, "--data-path $T/good.bin", 2, "give the prefix without .bin/.idx"),
    (DATA, "--data-path $T/trunc_bin", 2, "$T/trunc_bin.bin: size"),
    (DATA, "--data-path $T/trunc_idx", 2, "$T/trunc_idx.idx: size 40 bytes does not match header"),
    (DATA, "--data-path $T/magic", 2, "$T/magic.idx: not a Megatron MMIDIDX index"),
    (DATA, "--data-path $T/dtype", 2, "$T/dtype.idx: unknown dtype code 42"),
    (DATA, "--data-path $T/oov", 1, "holds token id 150, outside the model's vocabulary [0, 101)"),
    (DATA, "--data-path 0.5 $T/good 0.5 $T/oov", 1, "from $T/oov.bin"),
    (DATA, "--data-path $T/good --split 0,0,0", 2, "--split '0,0,0'"),
    (DATA, "--data-path $T/good --split a,b,c", 2, "--split 'a,b,c'"),
    (DATA, "--data-path -0.5 $T/good 1 $T/good", 2, "--data-path weights must be non-negative"),
    (DATA, "--data-path 0.5 $T/good $T/good", 2, "--data-path: give either 'weight prefix' pairs or only prefixes"),
    (DATA, "--data-path $T/good --tokenizer-type GPT2BPETokenizer", 2, "GPT2BPETokenizer needs --vocab-file"),
    (
        DATA,
        "--data-path $T/good --tokenizer-type GPT2BPETokenizer --vocab-file $T/none.json --merge-file $T/m",
        2,
        "--vocab-file $T/none.json: file not found",
    ),
    (DATA, "--data-path $T/good --tokenizer-type FooTokenizer", 2, "unknown --tokenizer-type 'FooTokenizer'"),
    # tokenizer files that are not what the flag names: the flag, the file and what to give instead
    (
        DATA,
        "--data-path $T/good --tokenizer-type SentencePieceTokenizer --tokenizer-model $T/afile",
        2,
        "--tokenizer-model $T/afile is not a SentencePiece model (could not parse ModelProto); give the .model file "
        "written by SentencePiece's trainer (e.g. tools/train_tokenizer.py --type sentencepiece)",
    ),
    (
        DATA,
        "--data-path $T/good --tokenizer-type Llama2Tokenizer --tokenizer-model $T",
        2,
        "--tokenizer-model $T is a directory, not a file",
    ),
    (
        DATA,
        "--data-path $T/good --tokenizer-type GPT2BPETokenizer --vocab-file $T/afile --merge-file $T/merges.txt",
        2,
        "--vocab-file $T/afile is not JSON (Expecting value at line 1 column 1); give GPT-2's vocab.json (an object "
        "mapping each token to its id)",
    ),
    (
        DATA,
        "--data-path $T/good --tokenizer-type GPT2BPETokenizer --vocab-file $T/list.json --merge-file $T/merges.txt",
        2,
        "--vocab-file $T/list.json is JSON but not a vocabulary",
    ),
    (
        DATA,
        "--data-path $T/good --tokenizer-type GPT2BPETokenizer --vocab-file $T/vocab.json --merge-file "
        "$T/bad_merges.txt",
        2,
        "--merge-file $T/bad_merges.txt line 2: expected two symbols separated by one space, "
        "got 'a b c'; give GPT-2's merges.txt",
    ),
    (
        DATA,
        "--data-path $T/good --tokenizer-type GPT2BPETokenizer --vocab-file $T/vocab.json --merge-file $T/latin1.txt",
        2,
        "--merge-file $T/latin1.txt is not UTF-8 text; give GPT-2's merges.txt (one 'a b' pair a line)",
    ),
    (DATA, "--data-path $T/good --data-cache-path $T/badcache", 2, "$T/badcache/"),
    # -- output paths ------------------------------------------------------------------------------
    (DATA, "--data-path $T/good --data-cache-path $T/afile", 2, "--data-cache-path $T/afile is a file"),
    (DATA, "--data-path $T/good --save $T/afile", 2, "--save $T/afile is a file, not a directory"),
    (DATA, "--data-path $T/good --save $T/afile/ckpt", 2, "--save $T/afile/ckpt cannot be created"),
    (DATA, "--data-path $T/good --tensorboard-dir $T/afile", 2, "--tensorboard-dir $T/afile is a file"),
    (DATA, "--data-path $T/good --timeline-out $T", 2, "--timeline-out $T is a directory"),
    (DATA, "--data-path $T/good --timeline-out $T/afile/t.json", 2, "--timeline-out (its directory) $T/afile"),
    (DATA, "--data-path $T/good --save /proc/megalite-ckpt", 2, "--save /proc/megalite-ckpt is not writable"),
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_data_dir(tmp_path_factory.mktemp("bad_inputs"))


@pytest.mark.parametrize("base,extra,code,text", CASES, ids=[c[1][:60] for c in CASES])
def test_bad_input_is_one_line(base, extra, code, text, data_dir, capsys):
    rc = pretrain_gpt.main(_argv(base, extra, data_dir))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == code
    assert len(err) == 1, err
    assert err[0].startswith("pretrain_gpt.py: error: ")
    assert text.replace("$T", str(data_dir)) in err[0]


def test_the_table_is_large_and_covers_flags_data_and_outputs():
    assert len(CASES) >= 50
    assert sum(base is DATA for base, *_ in CASES) >= 20


SUBPROCESS = [
    (MOCK, "--lr -1e-3", 2),
    (DATA, "--data-path $T/magic", 2),
    (DATA, "--data-path $T/oov", 1),
    (DATA, "--data-path $T/good --save $T/afile/ckpt", 2),
]


@pytest.mark.slow
def test_bad_input_as_a_process_has_no_traceback(data_dir):
    for base, extra, code in SUBPROCESS:
        proc = subprocess.run(
            [sys.executable, "pretrain_gpt.py"] + _argv(base, extra, data_dir),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        err = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == code, (extra, proc.stderr)
        assert len(err) == 1 and err[0].startswith("pretrain_gpt.py: error: "), (extra, proc.stderr)
        assert "Traceback" not in proc.stdout + proc.stderr


def test_eval_interval_0_is_accepted_when_evaluation_is_off():
    from megalite.config.arguments import parse_args

    cfg = parse_args(MOCK + ["--eval-interval", "0", "--eval-iters", "0"])
    assert (cfg.train.eval_interval, cfg.train.eval_iters) == (0, 0)


@pytest.mark.parametrize("logging_rank", [True, False])
def test_starting_from_scratch_is_said_once_per_job(tmp_path, caplog, monkeypatch, logging_rank):
    """Every rank finds no checkpoint under --load; only the logging rank says so (one line per job)."""
    import logging
    from types import SimpleNamespace

    monkeypatch.setattr(logging.getLogger("megalite"), "propagate", True)  # a run's setup_logging turned it off
    from megalite.checkpointing.manager import load_checkpoint
    from megalite.config import Config

    caplog.set_level("WARNING", logger="megalite")
    ps = SimpleNamespace(is_logging_rank=logging_rank, rank=0 if logging_rank else 1)
    assert load_checkpoint(RunParts(Config(), ps, [], None, None, None, None), str(tmp_path / "none")) is None
    said = [r.getMessage() for r in caplog.records]
    assert said == (
        [f"no latest_checkpointed_iteration.txt in {tmp_path / 'none'}: starting from scratch"] if logging_rank else []
    )
