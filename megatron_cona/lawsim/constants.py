"""Every published constant the law-based simulator uses, with its source: one table.

Values are the papers' own; nothing here is fitted to this project's results. ``kind`` says how
a value enters: ``law`` (a fitted law), ``recipe`` (what a paper trained with), ``check`` (a
published result the sanity checks compare against), ``measured`` (measured by this project
on its own real loop, with the command) or ``model`` (a modelling choice of this simulator, not
a paper's figure, stated as such).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Constant:
    value: float
    unit: str
    source: str
    kind: str = "law"


CONSTANTS: dict[str, Constant] = {
    # Kaplan et al. 2020, "Scaling Laws for Neural Language Models": L(N, S_min), Eq 1.6 / Table 3
    "alpha_N": Constant(0.077, "", "Kaplan et al. 2020, Eq 1.6, Table 3 (fit of L(N, S))"),
    "alpha_S": Constant(0.76, "", "Kaplan et al. 2020, Eq 1.6, Table 3"),
    "N_c": Constant(6.5e13, "non-embedding params", "Kaplan et al. 2020, Eq 1.6, Table 3"),
    "S_c": Constant(2.1e3, "steps", "Kaplan et al. 2020, Eq 1.6, Table 3"),
    # critical batch B_crit(L) = B* / L^(1/alpha_B)
    "B_star": Constant(2e8, "tokens", "Kaplan et al. 2020, Eq 5.3 (B* ~ 2e8 tokens)"),
    "alpha_B": Constant(0.21, "", "Kaplan et al. 2020, Eq 5.3 (alpha_B ~ 0.21)"),
    # B_crit growing with the data seen (the variant): B_crit ~ D^0.47
    "crit_batch_data_exponent": Constant(
        0.47, "", "Zhang et al. 2024, 'How Does Critical Batch Size Scale in Pre-training?' "
        "(CBS ~ D^0.47); Bergsma et al. 2025 'Power Lines' find B_crit growing with D alike"),
    # compute-optimal data: 20 tokens per parameter
    "tokens_per_param": Constant(20.0, "tokens/param", "Hoffmann et al. 2022 (Chinchilla), "
                                 "Table 3 / Sec 3: ~20 tokens per parameter", "recipe"),
    # the batches the models' own papers trained with (the planner's batch)
    "gpt3_1p3b_batch_tokens": Constant(2**20, "tokens", "Brown et al. 2020 (GPT-3), Table 2.1: "
                                       "GPT-3 XL (1.3B) batch 1M tokens (512 x 2,048)",
                                       "recipe"),
    "gpt3_seq": Constant(2048, "tokens", "Brown et al. 2020, Sec 2.1 (n_ctx = 2048)", "recipe"),
    "gpt3_rampup_start_tokens": Constant(32e3, "tokens", "Brown et al. 2020, Appendix B: batch "
                                         "ramped linearly from 32k tokens", "recipe"),
    "gpt3_rampup_tokens_lo": Constant(4e9, "tokens", "Brown et al. 2020, Appendix B: ramp over "
                                      "the first 4-12 billion tokens", "recipe"),
    "gpt3_rampup_tokens_hi": Constant(12e9, "tokens", "Brown et al. 2020, Appendix B", "recipe"),
    "bert_batch_seqs": Constant(256, "sequences", "Devlin et al. 2019 (BERT), Appendix A.2: "
                                "256 sequences x 512 tokens", "recipe"),
    "bert_seq": Constant(512, "tokens", "Devlin et al. 2019, Appendix A.2", "recipe"),
    "llama3_batch_tokens": Constant(2**22, "tokens", "Dubey et al. 2024 (Llama 3), Sec 3.4.1: "
                                    "initial batch 4M tokens (1,024 x 4,096)", "recipe"),
    "llama3_seq": Constant(4096, "tokens", "Dubey et al. 2024, Sec 3.4.1", "recipe"),
    # BERT's masked-LM family: B* and the loss scale from one published figure of the family
    "roberta_best_batch_seqs": Constant(
        2048, "sequences of 512", "Liu et al. 2019 (RoBERTa), Table 3: BERT-base at equal "
        "compute, batch 2K (125K steps) best of 256 / 2K / 8K: taken as B_crit there", "recipe"),
    "roberta_steps": Constant(125e3, "steps", "Liu et al. 2019, Table 3 (batch 2K row)",
                              "recipe"),
    "roberta_ppl": Constant(3.68, "perplexity", "Liu et al. 2019, Table 3 (batch 2K row, "
                            "held-out MLM perplexity)", "recipe"),
    "bert_base_nonembedding_params": Constant(85e6, "params", "Devlin et al. 2019: BERT-base "
                                              "12 layers x 12 h^2, h = 768", "recipe"),
    # OLMo-1B as measured by branched training (the noise-bias and plateau variants); the
    # numbers as read from a summary of the paper ([secondary] in shared/notes/field.md)
    "olmo_bcrit_anchor_tokens": Constant(
        50e9, "tokens", "Merrill et al. 2025 (arXiv 2505.23971), OLMo-1B: critical batch "
        "~2,048 documents after ~50B tokens [secondary]"),
    "olmo_bcrit_anchor_docs": Constant(2048, "documents", "Merrill et al. 2025, OLMo-1B "
                                       "[secondary]"),
    "olmo_bcrit_plateau_docs": Constant(4096, "documents", "Merrill et al. 2025, OLMo-1B: "
                                        "plateau near 4,096 documents (~16.8M tokens) from "
                                        "~200-400B tokens [secondary]"),
    "olmo_seq": Constant(4096, "tokens", "Merrill et al. 2025: 4,096 documents = ~16.8M "
                         "tokens, i.e. 4,096-token documents [secondary]", "recipe"),
    "noise_scale_bias_lo": Constant(10.0, "x", "Merrill et al. 2025: McCandlish's simple noise "
                                    "scale (~5-50 sequences) lies 10-100x below the branched "
                                    "critical batch [secondary]: the low end"),
    "noise_scale_bias_hi": Constant(100.0, "x", "Merrill et al. 2025 [secondary]: the high "
                                    "end"),
    # the loss a controller reads is noisy: the per-step noise our real loop shows
    "loss_noise_per_token": Constant(
        3.7, "nats x sqrt(tokens)", "measured by this project (2026-12-04) on its real "
        "Megatron-Core CPU loop: scripts/cona_cpu.py pretrain --nproc 1 (2 layers, hidden 64, "
        "4 heads, seq 64, micro 8, global batch 16, lr 2e-3 constant, 300 iterations): the "
        "training loss's residual around a local quadratic trend (21-step windows, iterations "
        "60-290) has std 0.116 nats at 1,024 tokens per step; a step of T tokens is given "
        "3.7 / sqrt(T) (tokens taken as independent)", "measured"),
    # sanity checks
    "bcrit_doubling_loss_drop": Constant(0.13, "fraction", "issue 34 from Kaplan Eq 5.3: "
                                         "B_crit doubles per ~13% loss decrease", "check"),
    "merrill_step_saving": Constant(0.43, "fraction", "Merrill et al. 2025, 'Critical Batch "
                                    "Size Revisited': OLMo-1B batch-size warmup reaches the "
                                    "loss with ~43% fewer gradient steps", "check"),
    # the simulated probe
    "probe_effective_dims": Constant(1e3, "dimensions", "modelling choice of this simulator: "
                                     "tr(S)^2 / tr(S^2) of the gradient noise, sets the sampling "
                                     "noise of the squared-norm readings (no paper value)",
                                     "model"),
}


def value(name: str) -> float:
    """A constant's value; a clear error names an unknown constant."""
    try:
        return CONSTANTS[name].value
    except KeyError:
        raise KeyError(f"constant {name!r} is not in the lawsim constants table") from None
