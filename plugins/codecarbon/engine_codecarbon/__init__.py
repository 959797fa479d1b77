"""CodeCarbon emissions tracking for the engine (``plugins = ["codecarbon"]``, Trainer's ``report_to``).

A CodeCarbon tracker measures the energy the machine uses while the run trains and the CO2 it
emits: it starts when training starts (``log_hyperparams``, on the main process) and stops when
training ends. CodeCarbon writes one row per tracker into ``output_dir/emissions.csv``, and its
figures join the end-of-training summary (``train_runtime``, ...) through ``on_train_summary``,
so they are in ``metrics.jsonl``, every tracker and what ``Run.train()`` returns:
``train_emissions_kg``, ``train_energy_consumed_kwh``, ``train_cpu_energy_kwh``,
``train_gpu_energy_kwh``, ``train_ram_energy_kwh``, ``train_emissions_rate_kg_per_s`` and
``train_emissions_duration_s``. A run that raised is stopped at its end (its CSV row counts
what it used) and has no summary.

Offline by default (``OfflineEmissionsTracker``): the carbon intensity comes from CodeCarbon's
tables for ``country_iso_code`` (the world average without it), nothing goes over the network.
``offline = false`` uses ``EmissionsTracker``, which asks two geolocation services for the
country (0.5 s each at most) and sends to CodeCarbon's API only where CodeCarbon's own config
says so (its API key is CodeCarbon's business: this plugin never reads it). No sudo or RAPL
access is needed: without readable RAPL files CodeCarbon estimates the CPU's power from its
load and a TDP table (it says so in a warning), the RAM's from its size, and reads NVIDIA GPUs
through NVML when there are any. CodeCarbon's log is cut to warnings (``log_level``).

Starting costs about 2 s once per process (importing pandas, matching the CPU in CodeCarbon's
TDP table), a few ms afterwards; CodeCarbon then measures from a thread of its own every
``measure_power_secs``, and stopping takes a few ms.

Resume: each training process is one CodeCarbon run (one CSV row, its own ``run_id``); a
resumed training appends its row with the same project and experiment, and its summary counts
what the resumed part used (add the rows up for the whole training). A failure of CodeCarbon
(it logs its own errors and returns nothing) is raised at the next logging hook, where the
engine reports it by name and switches the plugin off (``strict``: ends the run).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from engine import hookimpl, option
from engine.tracking import Tracker, tracker_run_name

# the final metrics, from codecarbon's EmissionsData (the columns of emissions.csv), in its units
METRICS = {
    "train_emissions_kg": "emissions",
    "train_emissions_rate_kg_per_s": "emissions_rate",
    "train_energy_consumed_kwh": "energy_consumed",
    "train_cpu_energy_kwh": "cpu_energy",
    "train_gpu_energy_kwh": "gpu_energy",
    "train_ram_energy_kwh": "ram_energy",
    "train_emissions_duration_s": "duration",
}
OFFLINE_ONLY = ("country_iso_code", "region", "cloud_provider", "cloud_region")  # OfflineEmissionsTracker's
PASSED = ("project_name", "experiment_id", "experiment_name", "measure_power_secs", "tracking_mode", "pue",
          *OFFLINE_ONLY)


@dataclass
class CodeCarbonOptions:
    offline: bool = option(True, help=(
        "OfflineEmissionsTracker (no network; the carbon intensity of country_iso_code); false: EmissionsTracker "
        "(finds the country from the machine's IP address)"))
    country_iso_code: str | None = option(None, help=(
        "offline: 3-letter ISO code of the machine's country (e.g. 'USA', 'FRA'); default codecarbon's config, "
        "else CodeCarbon uses the world average"))
    region: str | None = option(None, help="offline: the province or state (USA, Canada) for a finer intensity")
    cloud_provider: str | None = option(None, help="offline: the cloud provider ('aws', 'gcp', 'azure')")
    cloud_region: str | None = option(None, help="offline: the cloud region, whose intensity then counts")
    project_name: str | None = option(None, help=(
        "codecarbon's project_name column; default codecarbon's config, else the run's name (train.run_name or "
        "output_dir's)"))
    experiment_id: str | None = option(None, help="codecarbon's experiment_id column; default codecarbon's")
    experiment_name: str | None = option(None, help="codecarbon's experiment name; default codecarbon's")
    measure_power_secs: float | None = option(None, min=0.1, help=(
        "seconds between power measurements; default codecarbon's (15)"))
    tracking_mode: Literal["machine", "process"] | None = option(None, help=(
        "'machine': the whole machine's power (codecarbon's default); 'process': this process's share"))
    pue: float | None = option(None, min=1, help="the data center's power usage effectiveness; default 1")
    log_level: Literal["debug", "info", "warning", "error", "critical"] = option("warning", help=(
        "CodeCarbon's log level (its own default, info, prints a dozen lines per run)"))
    strict: bool = option(False, help="a tracking failure ends the run (default: reported, then switched off)")


class CodeCarbonTracker(Tracker):
    extra, package, options = "codecarbon", "codecarbon", CodeCarbonOptions

    def __init__(self):
        super().__init__()
        self.tracker = None
        self.error: Exception | None = None  # met while stopping in on_train_summary, raised by log_metrics

    @hookimpl
    def log_hyperparams(self, run):
        import codecarbon
        from codecarbon.core.config import get_hierarchical_config

        options = run.config.section("codecarbon")
        logging.getLogger("codecarbon").setLevel(options.log_level.upper())  # before it logs its config, at info
        settings = {name: getattr(options, name) for name in PASSED if getattr(options, name) is not None}
        if not options.offline:
            settings = {name: value for name, value in settings.items() if name not in OFFLINE_ONLY}
        if "project_name" not in settings and "project_name" not in get_hierarchical_config():
            settings["project_name"] = tracker_run_name(run)
        make = codecarbon.OfflineEmissionsTracker if options.offline else codecarbon.EmissionsTracker
        run.output_dir.mkdir(parents=True, exist_ok=True)
        self.tracker = make(output_dir=str(run.output_dir), log_level=options.log_level, **settings)
        self.tracker.start()

    def _stop(self) -> dict[str, float]:
        tracker, self.tracker = self.tracker, None
        if tracker.stop() is None:  # codecarbon logs what went wrong and returns nothing
            raise RuntimeError("codecarbon: the emissions tracker failed (its warnings above say why); "
                               "no emissions measured")
        return {name: float(getattr(tracker.final_emissions_data, field)) for name, field in METRICS.items()}

    @hookimpl
    def on_train_summary(self, run, metrics):
        if self.tracker is not None:
            try:
                metrics.update(self._stop())
            except Exception as exc:  # this hook is not isolated: the summary's log_metrics raises it
                self.error = exc

    @hookimpl
    def log_metrics(self, run, metrics, step):
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    @hookimpl
    def log_finish(self, run, status):
        if self.tracker is not None:  # training raised before its summary: the CSV row still counts
            self._stop()
