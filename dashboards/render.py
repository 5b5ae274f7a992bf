"""Render the dashboards' panels from a live Prometheus into PNG pictures (matplotlib).

Not Grafana: an approximation of each panel kind (time series, stat, state timeline, table,
heatmap) laid out on the dashboard's grid, drawn from the same queries Grafana would run. Used
for the pictures in docs/dashboards.md (``docs/img/*.png``)::

    python -m dashboards.render --prometheus-url http://127.0.0.1:9090 --out docs/img --since 5m

Nothing is written when no Prometheus answers at --prometheus-url, or when --job is not given
and it has no job with ``lightkeeper_step`` series (exit 2); panels that fail are drawn as errors
and listed on stderr (exit 1).

The dashboards e2e test renders them from its live run when ``LIGHTKEEPER_DOCS_IMG=DIR`` is set.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import requests

from .build import build_dashboards
from .validate import iter_panels, substitute

BG, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"
COLORS = {"green": "#73bf69", "red": "#f2495c", "orange": "#ff9830", "yellow": "#fade2a",
          "blue": "#5794f2", "purple": "#b877d9", "text": "#ccccdc"}
PALETTE = ["#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9",
           "#705da0", "#37872d", "#fade2a"]


class Prom:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def _get(self, path: str, **params: Any) -> Any:
        body = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=30).json()
        if body.get("status") != "success":
            raise RuntimeError(body.get("error"))
        return body["data"]

    def reachable(self) -> str | None:
        """Why no Prometheus query API answers at the URL (None: one does)."""
        try:
            self._get("query", query="1")
        except requests.ConnectionError:
            return "cannot connect"
        except requests.Timeout:
            return "no answer in time"
        except (requests.RequestException, RuntimeError, ValueError, AttributeError) as e:
            return f"not a Prometheus query API ({e})"
        return None

    def instant(self, expr: str, at: float) -> list[dict]:
        data = self._get("query", query=expr, time=str(at))
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        return self._get("query_range", query=expr, start=str(start), end=str(end),
                         step=str(step))["result"]

    def jobs(self, start: float, end: float) -> list[str] | None:
        """The jobs with ``lightkeeper_step`` series between ``start`` and ``end``, in
        Grafana's natural order (the ``$job`` variable's sort); None: no answer."""
        try:
            jobs = self._get("label/job/values", start=str(start), end=str(end),
                             **{"match[]": "lightkeeper_step"})
        except (requests.RequestException, RuntimeError, ValueError, AttributeError):
            return None
        return sorted(jobs, key=natural_key)

    def first_job(self, start: float, end: float) -> str | None:
        """The first of :meth:`jobs` (None: none, or no answer)."""
        return (self.jobs(start, end) or [None])[0]


def natural_key(text: str) -> list:
    """``train-9`` before ``train-10``, case aside, as Grafana's natural sort orders them."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part.lower())
            for part in re.split(r"(\d+)", text) if part]


def legend(fmt: str, metric: dict) -> str:
    if not fmt or fmt == "__auto":
        labels = {k: v for k, v in metric.items() if k not in ("__name__", "instance")}
        return ", ".join(f"{k}={v}" for k, v in sorted(labels.items())) or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt)


def _mapping(panel: dict) -> dict[str, tuple[str, str]]:
    out = {}
    for m in panel.get("fieldConfig", {}).get("defaults", {}).get("mappings", []):
        out.update(_map_options(m))
    return out


def _map_options(m: dict) -> dict[str, tuple[str, str]]:
    """One Grafana value map as ``{"1": (text, color)}``; a special map of NaN as key ``nan``
    (how ``f"{value:g}"`` writes NaN)."""
    def entry(k: str, v: dict) -> tuple[str, str]:
        return v.get("text", k), COLORS.get(v.get("color", ""), v.get("color", TEXT))

    if m.get("type") == "special":
        o = m.get("options", {})
        return {"nan": entry("nan", o.get("result", {}))} if o.get("match") == "nan" else {}
    return {k: entry(k, v) for k, v in m.get("options", {}).items()}


def _override_mappings(panel: dict) -> dict[str, dict[str, tuple[str, str]]]:
    """Field name -> its value mappings, from the panel's by-name overrides."""
    out: dict[str, dict[str, tuple[str, str]]] = {}
    for o in panel.get("fieldConfig", {}).get("overrides", []):
        if o.get("matcher", {}).get("id") != "byName":
            continue
        for prop in o.get("properties", []):
            if prop.get("id") == "mappings":
                name = o["matcher"]["options"]
                for m in prop.get("value") or []:
                    out.setdefault(name, {}).update(_map_options(m))
    return out


def _threshold_color(panel: dict, value: float) -> str:
    steps = panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps", [])
    color = "green"
    for s in steps:
        if s["value"] is None or value >= s["value"]:
            color = s["color"]
    return COLORS.get(color, color)


def _fmt(value: float, unit: str) -> str:
    if value != value:  # NaN
        return "NaN"
    if unit == "s":
        if abs(value) >= 120:
            return f"{value / 60:.1f} min"
        return f"{value:.3g} s"
    if unit.startswith("suffix:"):
        return f"{value:.3g}{unit[len('suffix:'):]}"
    if unit in ("none", "") and value.is_integer():  # a step: 123456, not 1.235e+05
        return f"{value:.0f}"
    return f"{value:.4g}"


class Renderer:
    def __init__(self, prom: Prom, start: float, end: float, variables: dict[str, str],
                 builtins: dict[str, str]) -> None:
        self.prom, self.start, self.end = prom, start, end
        self.step = max(1.0, (end - start) / 240)
        self.variables, self.builtins = variables, builtins
        self.errors: list[str] = []  # "dashboard / panel: error" for panels that failed

    def expr(self, t: dict) -> str:
        return substitute(t["expr"], self.variables, self.builtins)

    def _style(self, ax) -> None:
        ax.set_facecolor(PANEL)
        for s in ax.spines.values():
            s.set_color(GRID)
        ax.tick_params(colors=TEXT, labelsize=6)
        ax.grid(True, color=GRID, linewidth=0.5)

    def _time_axis(self, ax, p: dict) -> None:
        import matplotlib.dates as mdates

        ax.set_xlim(datetime.fromtimestamp(self.start), datetime.fromtimestamp(self.end))
        ticks = max(2, p["gridPos"]["w"] // 2)
        ax.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=2, maxticks=ticks))
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))

    def timeseries(self, ax, p: dict) -> None:
        self._style(ax)
        i = 0
        bars = p["fieldConfig"]["defaults"].get("custom", {}).get("drawStyle") == "bars"
        for t in p["targets"]:
            for series in self.prom.range(self.expr(t), self.start, self.end, self.step):
                xs = [datetime.fromtimestamp(float(v[0])) for v in series["values"]]
                ys = [float(v[1]) for v in series["values"]]
                color = PALETTE[i % len(PALETTE)]
                label = legend(t.get("legendFormat", ""), series["metric"])
                if bars:
                    ax.bar(xs, ys, width=self.step / 86400 * 0.8, color=color, label=label)
                else:
                    step = p["fieldConfig"]["defaults"]["custom"].get("lineInterpolation")
                    ax.plot(xs, ys, color=color, linewidth=1, label=label,
                            drawstyle="steps-post" if step == "stepAfter" else "default")
                i += 1
        self._time_axis(ax, p)
        unit = p["fieldConfig"]["defaults"].get("unit", "")
        if unit == "s":
            ax.set_ylabel("seconds", color=TEXT, fontsize=6)
        if i:
            ax.legend(fontsize=5, loc="upper left", facecolor=PANEL, edgecolor=GRID,
                      labelcolor=TEXT, ncol=2 if i > 4 else 1)
        else:
            ax.text(0.5, 0.5, "No data", color=TEXT, ha="center", va="center",
                    transform=ax.transAxes)

    def stat(self, ax, p: dict) -> None:
        ax.set_facecolor(PANEL)
        ax.set_xticks([])
        ax.set_yticks([])
        result = self.prom.instant(self.expr(p["targets"][0]), self.end)
        if not result:
            ax.text(0.5, 0.45, "No data", color=TEXT, ha="center", va="center", fontsize=12)
            return
        unit = p["fieldConfig"]["defaults"].get("unit", "")
        fmt = p["targets"][0].get("legendFormat", "")
        result = sorted(result, key=lambda r: legend(fmt, r["metric"]))
        n = len(result)
        for i, r in enumerate(result):  # several series: side by side, named, as Grafana does
            value = float(r["value"][1])
            mapped = _mapping(p).get(f"{value:g}")
            text, color = mapped if mapped else (_fmt(value, unit), _threshold_color(p, value))
            x = (i + 0.5) / n
            ax.text(x, 0.42, text, color=color, ha="center", va="center",
                    fontsize=18 if n == 1 else 12, weight="bold", transform=ax.transAxes)
            if n > 1:
                ax.text(x, 0.8, legend(fmt, r["metric"]), color=TEXT, ha="center",
                        va="center", fontsize=6, transform=ax.transAxes)

    def state_timeline(self, ax, p: dict) -> None:
        from matplotlib.patches import Patch

        self._style(ax)
        mapping = _mapping(p)
        rows = []
        for t in p["targets"]:
            for s in self.prom.range(self.expr(t), self.start, self.end, self.step):
                rows.append((legend(t.get("legendFormat", ""), s["metric"]), s["values"]))
        rows.sort()
        width = self.step / 86400
        for y, (_name, values) in enumerate(rows):
            for ts, v in values:
                text, color = mapping.get(f"{float(v):g}", (v, _threshold_color(p, float(v))))
                ax.barh(y, width, left=datetime.fromtimestamp(float(ts)), height=0.8,
                        color=color, linewidth=0)
        ax.set_yticks(range(len(rows)), [r[0] for r in rows])
        self._time_axis(ax, p)
        ax.grid(False)
        shown = {}
        for text, color in mapping.values():
            shown.setdefault(text, color)
        handles = [Patch(color=c, label=t) for t, c in shown.items()]
        ax.legend(handles=handles, fontsize=5, loc="upper left", facecolor=PANEL, ncol=5,
                  edgecolor=GRID, labelcolor=TEXT, bbox_to_anchor=(0.55, 1.0))

    def table(self, ax, p: dict) -> None:
        ax.set_facecolor(PANEL)
        ax.axis("off")
        rows: dict[tuple, dict[str, str]] = {}
        frames = []
        for t in p["targets"]:
            frames.append((t["refId"], self.prom.instant(self.expr(t), self.end)))
        label_sets = [set(r["metric"]) for _, res in frames for r in res]
        common = sorted(set.intersection(*label_sets)) if label_sets else []
        single = len(frames) == 1
        for ref, res in frames:
            for r in res:
                key = tuple(r["metric"].get(k) for k in common)
                row = rows.setdefault(key, {})
                row.update(r["metric"])
                row["Value" if single else f"Value #{ref}"] = _fmt(float(r["value"][1]), "")
        organize = next((tr["options"] for tr in p.get("transformations", [])
                         if tr["id"] == "organize"), {})
        exclude = {k for k, v in organize.get("excludeByName", {}).items() if v}
        order = organize.get("indexByName", {})
        rename = organize.get("renameByName", {})
        cols = sorted({c for r in rows.values() for c in r} - exclude - {"__name__", "instance"},
                      key=lambda c: (order.get(c, 99), c))
        if not rows:
            ax.text(0.5, 0.5, "No data", color=TEXT, ha="center", va="center")
            return
        value_maps = _override_mappings(p)

        def cell(r: dict[str, str], c: str) -> str:
            v = str(r.get(c, ""))
            return value_maps.get(rename.get(c, c), {}).get(v, (v, ""))[0]

        body = [[cell(r, c) for c in cols] for _, r in sorted(rows.items())]
        tbl = ax.table(cellText=body, colLabels=[rename.get(c, c) for c in cols], loc="upper left",
                       cellLoc="left")
        tbl.auto_set_font_size(False)
        tbl.set_fontsize(6)
        for cell in tbl.get_celld().values():
            cell.set_facecolor(PANEL)
            cell.set_edgecolor(GRID)
            cell.get_text().set_color(TEXT)

    def heatmap(self, ax, p: dict) -> None:
        import numpy as np

        self._style(ax)
        series = self.prom.range(self.expr(p["targets"][0]), self.start, self.end, self.step)
        series = [s for s in series if s["metric"].get("le") not in (None, "+Inf")]
        series.sort(key=lambda s: float(s["metric"]["le"]))
        if not series:
            ax.text(0.5, 0.5, "No data", color=TEXT, ha="center", va="center",
                    transform=ax.transAxes)
            return
        times = sorted({float(v[0]) for s in series for v in s["values"]})
        index = {t: i for i, t in enumerate(times)}
        grid = np.zeros((len(series), len(times)))
        for row, s in enumerate(series):
            for ts, v in s["values"]:
                grid[row, index[float(ts)]] = float(v)
        # bucket counts are cumulative: per-bucket = difference to the bucket below
        grid = np.diff(np.vstack([np.zeros(len(times)), grid]), axis=0).clip(min=0)
        ax.imshow(grid ** 0.5, aspect="auto", origin="lower", cmap="inferno",
                  extent=(0, len(times), 0, len(series)))
        ax.set_yticks([i + 0.5 for i in range(len(series))],
                      [f"≤{float(s['metric']['le']):g}s" for s in series])
        ax.set_xticks([])
        ax.grid(False)

    def text(self, ax, p: dict) -> None:
        ax.axis("off")

    def draw(self, dashboard: dict, out: Path) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        panels = list(iter_panels(dashboard))
        total_h = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
        unit_in = 0.34
        fig = plt.figure(figsize=(18, total_h * unit_in + 0.6), facecolor=BG)
        top_pad = 0.6 / (total_h * unit_in + 0.6)
        scale = 1 - top_pad
        fig.text(0.01, 1 - top_pad / 2, dashboard["title"], color=TEXT, fontsize=13,
                 weight="bold", va="center")
        for p in panels:
            g = p["gridPos"]
            x0, w = g["x"] / 24, g["w"] / 24
            y1 = 1 - top_pad - g["y"] / total_h * scale
            h = g["h"] / total_h * scale
            if p["type"] == "row":
                fig.text(x0 + 0.005, y1 - h / 2, p["title"], color=TEXT, fontsize=10,
                         weight="bold", va="center")
                continue
            title_h = 0.28 / (total_h * unit_in + 0.6)
            pad_b = (0.3 if p["type"] in ("timeseries", "state-timeline") else 0.08) / (
                total_h * unit_in + 0.6)
            left_pad = 0.07 * w if p["type"] in ("state-timeline", "heatmap") else 0.025 * w
            ax = fig.add_axes((x0 + left_pad, y1 - h + pad_b, w - left_pad - 0.006,
                               h - title_h - pad_b))
            fig.text(x0 + 0.004, y1 - title_h / 2, p["title"], color=TEXT, fontsize=8,
                     va="center")
            try:
                getattr(self, p["type"].replace("-", "_"))(ax, p)
            except Exception as e:  # a panel that cannot be drawn must not lose the others
                self.errors.append(f"{dashboard['title']} / {p['title']}: {e!r}")
                ax.text(0.5, 0.5, f"error: {e}", color=COLORS["red"], ha="center",
                        va="center", fontsize=6, transform=ax.transAxes)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=90, facecolor=BG)
        plt.close(fig)
        return out


def render_all(prometheus_url: str, out_dir: Path, *, start: float, end: float,
               variables: dict[str, str] | None = None, builtins: dict[str, str] | None = None,
               errors: list[str] | None = None, only: list[str] | None = None) -> list[Path]:
    """One PNG per dashboard (or those in ``only``, by file name) in ``out_dir``; panel
    failures are appended to ``errors``."""
    r = Renderer(Prom(prometheus_url), start, end, variables or {}, builtins or {})
    paths = [r.draw(d, Path(out_dir) / name.replace(".json", ".png"))
             for name, d in build_dashboards().items() if only is None or name in only]
    if errors is not None:
        errors.extend(r.errors)
    return paths


def _seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smh])", text)
    if not m or float(m.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 90s, 5m, 1h")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dashboards.render", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prometheus-url", required=True)
    # no default: a relative docs/img would overwrite the committed pictures from any checkout
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where the PNG files go (docs/img for the documentation's)")
    p.add_argument("--since", type=_seconds, default=_seconds("15m"), help="time range (15m)")
    p.add_argument("--job", help="value of the $job variable, one job (default: the first "
                                 "job Prometheus has lightkeeper_step series of)")
    args = p.parse_args(argv)
    prom = Prom(args.prometheus_url)
    why = prom.reachable()
    if why:  # before writing: pictures of nothing but errors would replace good ones
        p.error(f"--prometheus-url {args.prometheus_url}: {why}")
    # the dashboards match $job exactly: a regex such as .* would select nothing
    end = time.time()
    job = args.job or prom.first_job(end - args.since, end)
    known = prom.jobs(end - args.since, end) if args.job else None
    if known is not None and args.job not in known:  # a typo would draw empty pictures
        p.error(f"--job {args.job}: no lightkeeper_step series of it at {args.prometheus_url} "
                f"in the time range (jobs: {', '.join(known) or 'none'})")
    if job is None:
        p.error(f"--job: no job has lightkeeper_step series at {args.prometheus_url} in the "
                "time range; name the job")
    if not args.job:
        print(f"job: {job} (the first with lightkeeper_step series; --job for another)",
              file=sys.stderr)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        p.error(f"--out {args.out}: not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out {args.out}: {e.strerror}")
    errors: list[str] = []
    for path in render_all(args.prometheus_url, out, start=end - args.since, end=end,
                           variables={"job": job}, builtins={"$__rate_interval": "1m"},
                           errors=errors):
        print(f"wrote {path}")
    for e in errors:
        print(f"panel error: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
