/**
 * What a Lightkeeper dashboard is, in Grafana's own types.
 *
 * The types come from the npm package `@grafana/schema` (Grafana's dashboard model and the
 * options and field config of every core panel kind, pinned in package-lock.json).
 * `lightkeeper dashboards validate` (dashboards/schema_check.py) writes each dashboard JSON as
 * `const dashboard: LightkeeperDashboard = {...}` and runs `tsc --noEmit`: an unknown or misspelt
 * field, a wrong type, a missing required field or a value a panel option does not have is a
 * compile error, reported against the dashboard's JSON path.
 *
 * Only two small shapes are written here rather than imported, both transcribed from Grafana's
 * `@grafana/prometheus` 13.2.3 (that package brings React and the query editor with it):
 * the Prometheus query and the options its annotation support reads.
 */
import type * as common from "@grafana/schema";
import type * as heatmap from "@grafana/schema/dist/esm/raw/composable/heatmap/panelcfg/x/HeatmapPanelCfg_types.gen";
import type * as stat from "@grafana/schema/dist/esm/raw/composable/stat/panelcfg/x/StatPanelCfg_types.gen";
import type * as statetimeline from "@grafana/schema/dist/esm/raw/composable/statetimeline/panelcfg/x/StateTimelinePanelCfg_types.gen";
import type * as statushistory from "@grafana/schema/dist/esm/raw/composable/statushistory/panelcfg/x/StatusHistoryPanelCfg_types.gen";
import type * as table from "@grafana/schema/dist/esm/raw/composable/table/panelcfg/x/TablePanelCfg_types.gen";
import type * as text from "@grafana/schema/dist/esm/raw/composable/text/panelcfg/x/TextPanelCfg_types.gen";
import type * as timeseries from "@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen";
import type * as raw from "@grafana/schema/dist/esm/raw/dashboard/x/Dashboard_types.gen";

/**
 * A Grafana type as JSON spells it. TypeScript's string enums accept only their members
 * (`BigValueGraphMode.Area`), a JSON file has their values (`"area"`): every string enum becomes
 * the union of its values; everything else keeps its shape, optional fields stay optional and
 * unknown fields stay errors.
 */
export type Json<T> = T extends readonly (infer U)[]
  ? Json<U>[]
  : T extends string
    ? `${T}`
    : T extends number | boolean | null | undefined
      ? T
      : T extends object
        ? { [K in keyof T]: Json<T[K]> }
        : T;

/** A Prometheus query (`@grafana/prometheus` dist/types/dataquery.d.ts, `Prometheus`). */
export interface PrometheusQuery extends common.DataQuery {
  editorMode?: "builder" | "code";
  exemplar?: boolean;
  expr: string;
  format?: "time_series" | "table" | "heatmap";
  instant?: boolean;
  interval?: string;
  intervalFactor?: number;
  legendFormat?: string;
  range?: boolean;
}

/**
 * What the Prometheus data source reads from the annotation itself rather than from its query
 * (`@grafana/prometheus` annotations.ts, `processEvents`).
 */
export interface PrometheusAnnotationOptions {
  tagKeys?: string;
  textFormat?: string;
  titleFormat?: string;
  useValueForTime?: boolean;
}

export type Annotation = Omit<Json<raw.AnnotationQuery>, "target"> & {
  target?: Json<PrometheusQuery>;
} & PrometheusAnnotationOptions;

type FieldConfigSource<Custom> = Omit<Json<raw.FieldConfigSource>, "defaults"> & {
  defaults: Omit<Json<raw.FieldConfig>, "custom"> & { custom?: Json<Custom> };
};

/** A panel of kind `Type`: its options and `fieldConfig.defaults.custom` are that kind's. */
type PanelOf<Type extends string, Options, Custom> = Omit<
  Json<raw.Panel>,
  "type" | "options" | "fieldConfig" | "targets"
> & {
  type: Type;
  options?: Json<Options>;
  fieldConfig?: FieldConfigSource<Custom>;
  targets?: Json<PrometheusQuery>[];
};

/**
 * The panel kinds Lightkeeper's dashboards may use. A kind missing here is an error, never an
 * unchecked panel: add it with its module from @grafana/schema.
 */
export type Panel =
  | PanelOf<"timeseries", timeseries.Options, timeseries.FieldConfig>
  | PanelOf<"stat", stat.Options, never>
  | PanelOf<"table", table.Options, table.FieldConfig>
  | PanelOf<"state-timeline", statetimeline.Options, statetimeline.FieldConfig>
  | PanelOf<"status-history", statushistory.Options, statushistory.FieldConfig>
  | PanelOf<"heatmap", heatmap.Options, heatmap.FieldConfig>
  | PanelOf<"text", text.Options, never>;

export type RowPanel = Omit<Json<raw.RowPanel>, "panels"> & { panels: Panel[] };

export type LightkeeperDashboard = Omit<Json<raw.Dashboard>, "panels" | "annotations"> & {
  panels?: (Panel | RowPanel)[];
  annotations?: { list?: Annotation[] };
};
