"""Run by test_vllm_parity.py in a fresh interpreter: a platform that lists its
supported quantization methods (like ROCm and XPU) accepts 'kvscale' once the plugin
registered. Prints one RESULT line."""

import json

if __name__ == "__main__":
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    class ListingCpuPlatform(CpuPlatform):
        supported_quantization = ["fp8", "compressed-tensors"]

    platforms._current_platform = ListingCpuPlatform()  # before vLLM's registry imports it

    from kvscale_plugin.hosts.vllm import register

    register()
    register()  # idempotent: listed once
    accepted = True
    try:
        ListingCpuPlatform.verify_quantization("kvscale")
    except ValueError:
        accepted = False
    try:
        ListingCpuPlatform.verify_quantization("never-registered")
        control_refused = False
    except ValueError:
        control_refused = True
    print(
        "RESULT "
        + json.dumps(
            {
                "accepted": accepted,
                "control_refused": control_refused,
                "listed": ListingCpuPlatform.supported_quantization,
            }
        )
    )
