"""Print the markdown tables of bench/RESULTS.md from the committed JSON (no GPU needed).

    python bench/summarize.py
"""

import json
import os

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def kernel_table():
    rows = json.load(open(os.path.join(HERE, "h200.json")))
    meta = json.load(open(os.path.join(HERE, "h200_meta.json")))
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


if __name__ == "__main__":
    kernel_table()
    print()
    check_table()
    print()
    sft_table()
