"""The step profile (dopr/profiling.py): a CPU step counted and its table with CUDA counts, the device time of
the kernels alone (not the GPU spans of record_function ranges), and DoPr's phases named per size."""
import torch


def test_the_profile_counts_a_cpu_step_and_its_table_shows_cuda_counts():
    from dopr.profiling import profile_steps, table

    model = torch.nn.Linear(8, 4)
    p = profile_steps(lambda: model(torch.randn(16, 8)).sum().backward(), steps=2, device="cpu", top=3)
    assert p["wall_ms"] > 0 and p["busy_ms"] is None and len(p["top"]) == 3 and p["top"][0][1] > 0
    cuda = {"steps": 1, "device": "cuda", "wall_ms": 10.0, "busy_ms": 4.0, "kernels": 120.0,
            "syncs": {"cudaStreamSynchronize": 2.0}, "top": [("void gemm<float>|x", 2.0, 0.5)]}
    line = table([("dopr_adamw", cuda)]).splitlines()[-1]
    assert line == ("| dopr_adamw | 1 | 10.0 | 4.0 | 0.40 | 120 | cudaStreamSynchronize 2 | "
                    "`void gemm<float>/x` 2.00 (50%) |")


def test_the_device_time_counts_kernels_not_the_gpu_spans_of_record_function_ranges():
    # an H200 profile listed `Optimizer.step#DoPr.step` among the top kernels with 23% of the busy time and
    # reported busy / wall 1.87: the GPU-side span of the optimizer's record_function range covers the
    # kernels it launched, so adding it counted their time twice
    from types import SimpleNamespace as E

    from torch.autograd import DeviceType

    from dopr.profiling import device_events
    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    events = [E(key="Optimizer.step#DoPr.step", device_type=cpu, self_device_time_total=0),
              E(key="Optimizer.step#DoPr.step", device_type=cuda, self_device_time_total=900),
              E(key="ProfilerStep#1", device_type=cuda, self_device_time_total=50, is_user_annotation=True),
              E(key="aten::mm", device_type=cpu, self_device_time_total=0),
              E(key="sm90_xmma_gemm_bf16", device_type=cuda, self_device_time_total=400),
              E(key="Memcpy HtoD (Pageable -> Device)", device_type=cuda, self_device_time_total=5),
              E(key="idle", device_type=cuda, self_device_time_total=0)]
    assert [e.key for e in device_events(events)] == ["sm90_xmma_gemm_bf16", "Memcpy HtoD (Pageable -> Device)"]


def test_the_profile_names_dopr_s_phases_per_size():
    # a DoPr step's factorisations and solves run batched by size, each batch in a `dopr.*` span: the
    # profile lists them, so a GPU profile says which sizes take the step's time
    import dopr
    from dopr.profiling import phases_line, profile_steps

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    opt = dopr.build(model, "adamw", ap={}, lr=1e-3)
    x = torch.randn(64, 16)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    p = profile_steps(step, 1, "cpu")
    names = {name for name, _ in p["phases"]}
    # Sigma of the 32-wide inputs (with the bias: 33) twice, of the 16-wide input once; G by its shape
    assert names == {"dopr.factor 2 x (33, 33)", "dopr.factor 1 x (17, 17)", "dopr.apply 1 x (32, 17)",
                     "dopr.apply 1 x (32, 33)", "dopr.apply 1 x (4, 33)"}
    assert all(ms > 0 for _, ms in p["phases"])
    assert phases_line("r", p).startswith("- r: `") and phases_line("r", {"phases": []}) == "- r: -"
