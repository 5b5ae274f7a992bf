"""Small builders for Grafana dashboard JSON (Prometheus data source only).

Every function returns plain dicts in the shape Grafana saves (dashboard schema version 42,
Grafana 13) and that Grafana's ``@grafana/schema`` types describe (checked by
:mod:`dashboards.schema_check`); ``dashboards.build`` composes them. Panels are laid out
left to right in rows by :class:`Layout`, so a dashboard definition lists panels with a width
and a height and never computes grid positions by hand.
"""

from __future__ import annotations

from typing import Any

# The dashboard model of the pinned @grafana/schema (a test reads its defaultDashboard).
SCHEMA_VERSION = 42
DS = {"type": "prometheus", "uid": "${datasource}"}

Json = dict[str, Any]


# --- queries ------------------------------------------------------------------------------------
def target(expr: str, legend: str = "", *, ref: str = "A", instant: bool = False,
           fmt: str = "time_series") -> Json:
    """One Prometheus query of a panel."""
    t: Json = {
        "datasource": DS,
        "editorMode": "code",
        "expr": expr,
        "format": fmt,
        "legendFormat": legend or "__auto",
        "range": not instant,
        "instant": instant,
        "refId": ref,
    }
    return t


def targets(*specs: tuple[str, str] | str, instant: bool = False, fmt: str = "time_series"
            ) -> list[Json]:
    """Several queries with refIds A, B, C...; each spec is ``expr`` or ``(expr, legend)``."""
    out = []
    for i, spec in enumerate(specs):
        expr, legend = (spec, "") if isinstance(spec, str) else spec
        out.append(target(expr, legend, ref=chr(ord("A") + i), instant=instant, fmt=fmt))
    return out


# --- field config -------------------------------------------------------------------------------
def thresholds(*steps: tuple[float | None, str]) -> Json:
    """Absolute thresholds; the first step's value is ``None`` (-Infinity)."""
    return {"mode": "absolute", "steps": [{"value": v, "color": c} for v, c in steps]}


GREEN_ONLY = thresholds((None, "green"))


def value_mappings(mapping: dict[str, tuple[str, str]]) -> list[Json]:
    """``{"1": ("in quorum", "green")}`` -> one Grafana value map."""
    return [{"type": "value", "options": {
        k: {"text": text, "color": color, "index": i}
        for i, (k, (text, color)) in enumerate(mapping.items())}}]


def special_mapping(match: str, text: str, color: str = "text") -> Json:
    """A Grafana special-value map: ``match`` is ``nan``, ``null``, ``null+nan``, ``empty``..."""
    return {"type": "special", "options": {"match": match,
                                           "result": {"text": text, "color": color, "index": 0}}}


def field_defaults(*, unit: str = "short", custom: Json | None = None, decimals: float | None = None,
                   min_: float | None = None, max_: float | None = None,
                   thresholds_: Json | None = None, mappings: list[Json] | None = None,
                   color: str = "palette-classic", links: list[Json] | None = None,
                   no_value: str | None = None) -> Json:
    d: Json = {"unit": unit, "color": {"mode": color},
               "thresholds": thresholds_ or GREEN_ONLY, "mappings": mappings or []}
    if custom is not None:
        d["custom"] = custom
    if decimals is not None:
        d["decimals"] = decimals
    if min_ is not None:
        d["min"] = min_
    if max_ is not None:
        d["max"] = max_
    if links:
        d["links"] = links
    if no_value is not None:
        d["noValue"] = no_value
    return d


def data_link(title: str, url: str) -> Json:
    """A data link (Grafana stores them in the dashboard-link shape)."""
    return {"title": title, "type": "link", "url": url, "icon": "external link",
            "tooltip": title, "tags": [], "asDropdown": False, "targetBlank": True,
            "includeVars": False, "keepTime": False}


def override_by_name(name: str, **props: Any) -> Json:
    return {"matcher": {"id": "byName", "options": name},
            "properties": [{"id": k, "value": v} for k, v in props.items()]}


# --- panels -------------------------------------------------------------------------------------
def _panel(kind: str, title: str, description: str, tgts: list[Json], options: Json,
           defaults: Json, overrides: list[Json] | None = None, **extra: Any) -> Json:
    p: Json = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": tgts,
        "options": options,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
    }
    p.update(extra)
    return p


LEGEND = {"displayMode": "list", "placement": "bottom", "showLegend": True, "calcs": []}
TOOLTIP = {"mode": "multi", "sort": "desc"}


def timeseries(title: str, description: str, tgts: list[Json], *, unit: str = "short",
               draw: str = "line", stack: bool = False, fill: int = 10, min_: float | None = None,
               max_: float | None = None,
               interpolation: str = "linear", overrides: list[Json] | None = None,
               thresholds_: Json | None = None, threshold_style: str = "off",
               legend_calcs: list[str] | None = None) -> Json:
    custom: Json = {
        "drawStyle": draw,
        "lineWidth": 1,
        "lineInterpolation": interpolation,
        "fillOpacity": fill,
        "gradientMode": "none",
        "showPoints": "never",
        "pointSize": 4,
        "spanNulls": False,
        "axisPlacement": "auto",
        "axisLabel": "",
        "axisBorderShow": False,
        "barAlignment": 0,
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        "thresholdsStyle": {"mode": threshold_style},
        "hideFrom": {"legend": False, "tooltip": False, "viz": False},
    }
    legend = dict(LEGEND)
    if legend_calcs:
        legend = {**legend, "displayMode": "table", "calcs": legend_calcs}
    return _panel("timeseries", title, description, tgts,
                  {"legend": legend, "tooltip": TOOLTIP},
                  field_defaults(unit=unit, custom=custom, min_=min_, max_=max_,
                                 thresholds_=thresholds_),
                  overrides)


def stat(title: str, description: str, tgts: list[Json], *, unit: str = "short",
         thresholds_: Json | None = None, mappings: list[Json] | None = None,
         graph: str = "none", color_mode: str = "value", calc: str = "lastNotNull",
         decimals: float | None = None) -> Json:
    options = {
        "graphMode": graph,
        "colorMode": color_mode,
        "justifyMode": "auto",
        "textMode": "auto",
        "wideLayout": True,
        "showPercentChange": False,
        "percentChangeColorMode": "standard",
        "orientation": "auto",
        "reduceOptions": {"values": False, "calcs": [calc], "fields": ""},
    }
    return _panel("stat", title, description, tgts, options,
                  field_defaults(unit=unit, thresholds_=thresholds_, mappings=mappings,
                                 color="thresholds", decimals=decimals))


def state_timeline(title: str, description: str, tgts: list[Json], *,
                   mappings: list[Json], thresholds_: Json | None = None) -> Json:
    options = {
        "showValue": "auto",
        "rowHeight": 0.9,
        "mergeValues": True,
        "alignValue": "left",
        "legend": {**LEGEND, "showLegend": False},
        "tooltip": {"mode": "single", "sort": "none"},
    }
    custom = {"lineWidth": 0, "fillOpacity": 80,
              "hideFrom": {"legend": False, "tooltip": False, "viz": False}}
    return _panel("state-timeline", title, description, tgts, options,
                  field_defaults(custom=custom, mappings=mappings, color="thresholds",
                                 thresholds_=thresholds_))


def table(title: str, description: str, tgts: list[Json], *, links: list[Json] | None = None,
          transformations: list[Json] | None = None, overrides: list[Json] | None = None,
          sort_by: str | None = None, unit: str = "short") -> Json:
    options: Json = {
        "frameIndex": 0,
        "showHeader": True,
        "cellHeight": "sm",
    }
    if sort_by:
        options["sortBy"] = [{"displayName": sort_by, "desc": False}]
    custom = {"align": "auto", "cellOptions": {"type": "auto"}, "inspect": False,
              "filterable": False}
    return _panel("table", title, description, tgts, options,
                  field_defaults(unit=unit, custom=custom, links=links, color="thresholds"),
                  overrides, transformations=transformations or [])


def heatmap(title: str, description: str, tgts: list[Json], *, unit: str = "s") -> Json:
    options = {
        "calculate": False,
        "cellGap": 1,
        "color": {"mode": "scheme", "scheme": "Oranges", "fill": "dark-orange",
                  "scale": "exponential", "exponent": 0.5, "steps": 64, "reverse": False},
        "exemplars": {"color": "rgba(255,0,255,0.7)"},
        "filterValues": {"le": 1e-09},
        "legend": {"show": True},
        "rowsFrame": {"layout": "auto"},
        "showValue": "never",
        "tooltip": {"mode": "single", "yHistogram": True, "showColorScale": False},
        "yAxis": {"axisPlacement": "left", "unit": unit, "reverse": False},
    }
    custom = {"hideFrom": {"legend": False, "tooltip": False, "viz": False},
              "scaleDistribution": {"type": "linear"}}
    return _panel("heatmap", title, description, tgts, options,
                  field_defaults(unit=unit, custom=custom), maxDataPoints=60)


def text(title: str, content: str) -> Json:
    return {"type": "text", "title": title, "options": {"mode": "markdown", "content": content},
            "fieldConfig": {"defaults": {}, "overrides": []}}


# --- layout -------------------------------------------------------------------------------------
class Layout:
    """Places panels on Grafana's 24-column grid, left to right, wrapping into new rows."""

    def __init__(self) -> None:
        self.panels: list[Json] = []
        self.x = 0
        self.y = 0
        self.row_h = 0
        self.next_id = 1

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({"type": "row", "title": title, "collapsed": False,
                            "id": self._id(), "panels": [],
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}})
        self.y += 1

    def add(self, panel: Json, w: int, h: int) -> Json:
        if self.x + w > 24:
            self._newline()
        panel = {**panel, "id": self._id(), "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y}}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)
        return panel

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_h
        self.x = 0
        self.row_h = 0

    def _id(self) -> int:
        i = self.next_id
        self.next_id += 1
        return i


# --- templating and annotations -----------------------------------------------------------------
def datasource_variable() -> Json:
    return {"type": "datasource", "name": "datasource", "label": "Data source", "query": "prometheus",
            "current": {"selected": False, "text": "default", "value": "default"},
            "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1,
            "regex": "", "skipUrlSync": False}


def query_variable(name: str, label: str, query: str, *, multi: bool = True,
                   include_all: bool = True, sort: int = 7) -> Json:
    """A variable filled from ``label_values(...)``; "All" matches everything (``.*``)."""
    v: Json = {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DS,
        "query": query,
        "hide": 0,
        "includeAll": include_all,
        "multi": multi,
        "options": [],
        "refresh": 2,
        "regex": "",
        "skipUrlSync": False,
        "sort": sort,
    }
    if include_all:  # else Grafana selects the first value
        v["allValue"] = ".*"
        v["current"] = {"selected": True, "text": ["All"], "value": ["$__all"]}
    return v


def grafana_annotation() -> Json:
    """Grafana's built-in annotations (user-made ones) every dashboard has."""
    return {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard"}


def prometheus_annotation(name: str, expr: str, *, title: str, text: str, color: str,
                          tags: str = "") -> Json:
    """An annotation from a Prometheus query: one marker wherever the expression has a value.

    The query is the annotation's ``target`` (Grafana 13's model; older dashboards had ``expr``
    and ``step`` beside it); title, text and tags stay on the annotation, where the Prometheus
    data source reads them. The query steps ``$__interval`` apart, so an expression comparing
    values ``offset $__interval`` apart marks each change once."""
    return {"name": name, "datasource": DS, "enable": True, "hide": False, "iconColor": color,
            "target": {"datasource": DS, "expr": expr, "interval": "$__interval",
                       "refId": "Anno"},
            "titleFormat": title, "textFormat": text, "tagKeys": tags, "useValueForTime": False}


def dashboard(uid: str, title: str, description: str, tags: list[str], variables: list[Json],
              layout: Layout, annotations: list[Json] | None = None,
              links: list[Json] | None = None, refresh: str = "10s",
              time_from: str = "now-30m") -> Json:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": tags,
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "time": {"from": time_from, "to": "now"},
        "timepicker": {"refresh_intervals": ["5s", "10s", "30s", "1m", "5m"]},
        "refresh": refresh,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": links or [],
        "templating": {"list": variables},
        "annotations": {"list": [grafana_annotation(), *(annotations or [])]},
        "panels": layout.panels,
    }


def dashboard_link(title: str, tags: list[str]) -> Json:
    """A link bar entry to the other Lightkeeper dashboards (keeps time range and variables)."""
    return {"title": title, "type": "dashboards", "icon": "dashboard", "tooltip": "",
            "url": "", "tags": tags, "asDropdown": True, "targetBlank": False,
            "includeVars": True, "keepTime": True}
