"""The settings of `sparkserve train-draft`, written once: each field is a flag (dataclass_cli),
with its default and help here. No torch here, so the CLI builds its parser cheaply."""
from __future__ import annotations

from dataclasses import dataclass, field

STAGES = ("prompts", "distill", "features", "train", "eval")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_DRAFT_VOCAB = 8192
CE_TARGETS = ("hard", "soft")


def _h(default, help_: str):
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help_})
    return field(default=default, metadata={"help": help_})


@dataclass
class TrainConfig:
    """Training settings; `sparkserve train-draft` makes a flag of each field (dataclass_cli)."""
    steps: int = _h(1000, "training steps")
    seqs_per_step: int = _h(4, "sequences per step")
    anchors_per_seq: int = _h(32, "draft blocks (anchors) per sequence")
    lr: float = _h(6e-4, "peak learning rate (warmup, then cosine)")
    warmup_frac: float = _h(0.04, "share of the steps spent warming up")
    weight_decay: float = _h(0.0, "AdamW weight decay")
    # The draft memorises small data; dropout is there to find out whether that binds.
    dropout: float = _h(0.0, "dropout on the draft's target context and block output while training")
    # Serving anchors right after a miss, where drafts are harder than at uniform positions.
    walk_anchor_frac: float = _h(0.0, "share of training anchors moved to their greedy walk successor "
                                      "(where serving anchors: right after the draft's miss); needs "
                                      "greedy distillation")
    # Many anchors: the dense block mask's [Q, Q] part (Q = 7 x anchors) is zero off the diagonal.
    block_attention: bool = _h(False, "attention of the training blocks without the dense [blocks x blocks] "
                                      "part (same values up to rounding; faster with many anchors)")
    clip: float = _h(1.0, "gradient norm clip")
    decay_gamma: float = _h(4.0, "slot weights exp(-k / gamma)")
    ce_weight: float = _h(0.1, "weight of the cross-entropy term (DeepSpec: 0.1 CE + 0.9 L1 + 1.0 BCE)")
    # The teacher's whole distribution carries more than its sampled token (a T > 0 answer's token
    # may be one the target rated low); a one-hot teacher makes both the same loss.
    ce_target: str = field(default="hard", metadata={
        "help": "what the cross-entropy term learns: hard, the answer's next token (DeepSpec); soft, the "
                "teacher's distribution (the target's softmax, restricted to a reduced draft vocab)",
        "choices": CE_TARGETS})
    l1_weight: float = _h(0.9, "weight of the L1 distance to the target distribution")
    conf_weight: float = _h(1.0, "weight of the confidence head's BCE")
    # With one backbone layer, the confidence loss pulls on the features the drafts come from.
    conf_detach: bool = _h(False, "the confidence head's BCE trains the head only (its inputs, the "
                                  "backbone's hidden rows and the Markov codes, detached)")
    seed: int = _h(0, "seed of anchor sampling and initialisation")
    stop_after: int | None = _h(None, "stop (checkpointed) after this step, the schedule still that of "
                                      "--steps: a run split in parts, e.g. resumed on another number "
                                      "of ranks")
    log_every: int = _h(10, "append the step's loss to DIR/draft/train_log.jsonl every N steps")
    save_every: int = _h(200, "checkpoint every N steps (resumable)")
    # The final norm starts small (init_dspark_draft: no anchor echo through a tied head); a
    # faster rate lets the backbone's share of the logits grow within a short CPU run.
    final_norm_lr_mult: float = _h(20.0,
                                   "learning-rate multiple for the draft's small-initialised final norm")
    # A reduced-vocab draft's LM head is a copy of the target's rows; DeepSpec freezes it, and on
    # small data a trainable one mostly memorises.
    train_lm_head: bool = _h(False,
                             "also train a reduced-vocab draft's LM head (default: frozen, as DeepSpec)")
    val_every: int = _h(250, "validate every N steps (greedy tau on the validation prompts; the best "
                             "draft is kept in OUT/draft/best)")
    val_seqs: int = _h(48, "validation sequences scored each time")
    val_positions: int = _h(4000, "validation positions (uniform over every validation sequence) of the "
                                  "quick metrics: slot-1 accuracy, and without next tokens outside the "
                                  "draft vocab (0 = off)")


CACHE_FORMATS = ("fp16", "int8")


@dataclass
class PipelineConfig:
    """The pipeline's settings; `sparkserve train-draft` makes a flag of each field (dataclass_cli)
    and of each TrainConfig field."""
    out: str = field(metadata={"help": "output directory (every stage resumes from what is there)"})
    model_path: str | None = _h(None, "target model (default: the embedded SmolLM2)")
    stages: list[str] = _h(list(STAGES), "comma-separated subset of " + ",".join(STAGES))
    prompts_file: str | None = _h(None, "JSONL prompts (default: ShareGPT minus the held-out 2,000)")
    num_prompts: int = _h(2000, "training prompts to distill")
    prompts_offset: int = _h(0, "skip this many training prompts (add data in a new run without "
                                "repeating prompts)")
    code_math_frac: float | None = _h(None, "reorder the training prompts so this share asks for code or "
                                            "maths (e.g. 0.4; default: the source's own order)")
    later_turn_frac: float | None = _h(None, "interleave later user turns (with the conversation before "
                                             "them) among the first turns, this share of the training "
                                             "prompts (e.g. 0.3; the code/maths share is then the first "
                                             "turns'); default: ShareGPT's first turns come first")
    cache_format: str = field(default="fp16", metadata={
        "help": "the training feature cache: fp16 taps and final rows; int8: int8 taps with per-row "
                "scales and the teacher's top-32 log-probs on response rows (int8_cache.py; ~40 %% of "
                "the disk, written from the distillation log without a second copy; resumable). The "
                "validation cache stays fp16", "choices": CACHE_FORMATS})
    extra_features: list[str] = _h([], "comma-separated feature caches (other runs' OUT/features) to "
                                       "train on as well")
    max_new_tokens: int = _h(256, "distillation answer length")
    temperature: float = _h(0.0, "distillation temperature")
    second_answer_temperature: float | None = _h(None, "distil each training prompt twice: its answer at "
                                                       "--temperature and one sampled at this temperature "
                                                       "(e.g. 0.7; seeded by the prompt's line), both "
                                                       "trained on")
    distill_batch: int = _h(32, "requests in flight while distilling")
    max_prompt_tokens: int = _h(1024, "skip longer prompts when distilling (prefill would dominate)")
    # Architecture options (docs/design.md, the DSpark draft): stored in the draft's config.json. With
    # --init-draft they are added to that draft, starting as it (training/grow_draft.py).
    num_layers: int | None = _h(None, "draft depth (default 1; with --init-draft: that draft's, or more "
                                      "layers added as identity blocks)")
    draft_kv_heads: int | None = _h(None, "the draft's KV heads, the width of its read of the target "
                                          "context (default: the target's; its attention heads = the "
                                          "widest; with --init-draft: a multiple of that draft's)")
    tap_norm: bool = _h(False, "an RMSNorm per tap before fc (the taps enter at very different scales)")
    prev_context_fusion: bool = _h(False, "EAGLE-style fusion: a projection of the context row before "
                                          "the anchor added to every block row's input (starts at zero)")
    block_size: int = _h(7, "gamma")
    markov_rank: int = _h(64, "rank of the Markov head")
    draft_vocab_size: int | None = _h(None, f"score only the most frequent response ids (default "
                                            f"{DEFAULT_DRAFT_VOCAB}; 0 = the full vocab); with --init-draft: "
                                            "re-pick that draft's vocab at this size (default: keep it)")
    # The distilled answers are few; the training conversations' own replies stand in for more.
    vocab_count_replies: bool = _h(False, "pick the draft vocab on the distilled answers' token counts "
                                          "(x --vocab-distilled-weight) plus the training conversations' "
                                          "replies (ShareGPT's training part, or the prompts file's "
                                          "assistant turns), tokenized by the target's tokenizer")
    vocab_distilled_weight: float = _h(20.0, "with --vocab-count-replies: the weight of a distilled token")
    mask_token_id: int | None = _h(None, "the draft's mask token (default: a spare special token)")
    target_layer_ids: list[int] | None = _h(None, "comma-separated taps (default: 1, L/2, L-2)")
    markov_init: bool = _h(True, "start the Markov head as the responses' bigram fit")
    # A shipped draft continued on new data, grown by the architecture flags it lacks.
    init_draft: str | None = _h(None, "start from this draft's weights and config (fresh optimizer and "
                                      "schedule); --prev-context-fusion, a larger --num-layers or a "
                                      "wider --draft-kv-heads grow it, starting from its exact logits")
    val_prompts: int = _h(64, "held-out prompts distilled for validation: training logs their greedy tau "
                              "and keeps the best draft in OUT/draft/best (0 = no validation)")
    eval_prompts: int = _h(32, "held-out prompts per set scored by the eval stage")
    eval_max_new_tokens: int = _h(128, "answer length in the eval stage")
    labels: str = _h("generated", "generated: the target answers every prompt (self-distillation); "
                                  "prefill: one teacher-forced pass over the answer each prompt brings (a "
                                  "prompts-file conversation ending in an assistant turn; ShareGPT's own "
                                  "replies by default), labelled by the target's greedy argmax where the "
                                  "answer agrees with it; mix: both")
    prefill_frac: float | None = _h(None, "with --labels mix: the share of prompts labelled by prefill")
    target_url: list[str] | None = _h(None, "comma-separated URLs of `sparkserve serve` servers (or a "
                                            "router) to distil and capture through (/generate with "
                                            "return_hidden_states; serve with --enable-return-hidden-states "
                                            "--disable-radix-cache --hidden-state-layers TAPS), requests "
                                            "spread over them; --model-path names the same model (config, "
                                            "tokenizer and, for training, weights are read locally)")
    tp_size: int = _h(1, "the target's tensor-parallel size while distilling, capturing and evaluating")
    pp_size: int = _h(1, "the target's pipeline-parallel size (stages capture their own taps)")
    activation_quant: str = _h("int8", "the target's activations while distilling, capturing and evaluating "
                                       "(`serve --activation-quant`): train on what the served target runs")
    kv_cache_dtype: str = _h("auto", "the target's KV pool while distilling, capturing and evaluating "
                                     "(`serve --kv-cache-dtype`)")
    # The train stage's is resolved once per process (ranks.train_device) and carried by Ranks.
    device: str = field(default="auto", metadata={
        "help": "where the target engine (`serve --device`) and the train stage run: cpu, or cuda (under "
                "torchrun NCCL, rank r on GPU LOCAL_RANK); auto: cuda when torch sees a GPU (for "
                "training: one for each rank on the node), else cpu",
        "choices": DEVICES})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"cli": False})


