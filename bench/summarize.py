"""Print the markdown tables of bench/RESULTS.md from the committed JSON (no GPU needed).

    python bench/summarize.py
"""

import json
import os

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def kernel_table():
    rows = json.load(open(os.path.join(HERE, "h200_kernel2.json")))
    meta = json.load(open(os.path.join(HERE, "h200_kernel2_meta.json")))
    print(f"Card: {meta['card']}, {meta['date']}; torch {meta['torch']}, triton {meta['triton']}, liger-kernel "
          f"{meta['liger_kernel']}, cut-cross-entropy {meta['cut_cross_entropy']}; bf16 matmul "
          f"{meta['bf16_matmul_tflops']:.0f} TFLOP/s (8192^3, same run).\n")
    print("| N x H x V | impl | ms | floor ms | x floor | peak extra MiB (excl. grads) | incl. grads | err_dx | err_dw |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['N']}x{r['H']}x{r['V']} | {r['impl']} | error: {r['error'][:60]} |||||||")
            continue
        print(f"| {r['N']}x{r['H']}x{r['V']} | {r['impl']} | {r['ms']:.1f} | {r['floor_ms']:.1f} | {r['x_floor']:.2f} | "
              f"{r['peak_extra_mib']:.0f} | {r['peak_total_extra_mib']:.0f} | {r['err_dx']:.1e} | {r['err_dw']:.1e} |")


def check_table():
    data = json.load(open(os.path.join(HERE, "h200_check.json")))
    print("| backend | N x H x V | dtype | softcap | ignored | err_loss | err_dx | err_dw | torch err_dx / err_dw | deterministic |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in data["checks"]:
        if "err_dx" in r:
            t = f"{r['torch_err_dx']:.1e} / {r['torch_err_dw']:.1e}" if "torch_err_dx" in r else "-"
            print(f"| {r['backend']} | {r['N']}x{r['H']}x{r['V']} | {r['dtype']} | {r['softcap']} | {r['ignore']:.0%} | "
                  f"{r['err_loss']:.1e} | {r['err_dx']:.1e} | {r['err_dw']:.1e} | {t} | {r['deterministic']} |")
        else:
            print(f"| {r['backend']} | {r['N']}x{r['H']}x{r['V']} | {r['dtype']} | {r['softcap']} | 100% | loss {r['loss']} "
                  f"(finite) | grads zero: {r['grads_zero']} | | | {r['deterministic']} |")


def sft_table():
    rows = json.load(open(os.path.join(HERE, "h200_sft.json")))
    print("| model (2 layers, real head) | variant | tokens/s | peak GiB | step ms | losses |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r.get("rc"):
            print(f"| {r['model']} | {r['variant']} | failed: {r.get('error', '')[:60]} ||||")
            continue
        print(f"| {r['model']} | {r['variant']} | {r['tokens_per_s']:.0f} | {r['peak_gib']:.2f} | {r['step_s'] * 1e3:.0f} | "
              f"{', '.join(f'{x:g}' for x in r['losses'])} |")


def _bf16_ulp(x):
    import math

    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


def fsdp_table(name):
    """bench/multi_gpu_fsdp.py rows: per run tokens/s, peaks, and the curve against the plain run."""
    path = os.path.join(HERE, name)
    if not os.path.exists(path):
        return
    rows = json.load(open(path))
    plain = {(r["part"], r["model"], r["fsdp_version"]): r for r in rows if r["label"] == "plain" and not r.get("rc")}
    print("| part | model | run | FSDP | GPUs | tokens/GPU/step | steps | tokens/s/GPU | peak GiB/GPU | fwd+bwd / optimizer peak | loss curve vs plain |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("rc"):
            print(f"| {r['part']} | {r['model']} | {r['label']} | {r['fsdp_version']} | {r['nproc']} | | | failed: "
                  f"`{(r.get('error_line') or '')[:90]}` ||||")
            continue
        curve = ""
        ref = plain.get((r["part"], r["model"], r["fsdp_version"]))
        if ref is not None and ref is not r:
            ulps = [abs(a - b) / _bf16_ulp(b) for a, b in zip(r["step_losses"], ref["step_losses"])]
            curve = (f"max rel {r['max_rel_diff_vs_plain']:.1e}; {sum(u == 0 for u in ulps)}/{len(ulps)} steps equal, "
                     f"max {max(ulps):.0f} bf16 ulp")
        peaks = "/".join(f"{p:.2f}" for p in r["peak_gib_per_rank"])
        print(f"| {r['part']} | {r['model']} | {r['label']} | {r['fsdp_version']} | {r['nproc']} | {r['tokens_per_gpu_step']} | "
              f"{len(r['step_losses'])} | {r['tokens_per_s_per_gpu']:.0f} | {peaks} | {r['fwd_bwd_peak_gib']:.2f} / "
              f"{r['optimizer_peak_gib']:.2f} | {curve} |")


if __name__ == "__main__":
    kernel_table()
    print()
    check_table()
    print()
    sft_table()
    for name in sorted(os.listdir(HERE)):
        if name.endswith("_fsdp.json"):
            print(f"\n{name}:\n")
            fsdp_table(name)
