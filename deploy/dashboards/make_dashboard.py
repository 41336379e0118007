#!/usr/bin/env python3
"""Writes moe-serve.json, the Grafana dashboard of a moe-serve cluster, next to
this script: request latency and throughput from the coordinators (vLLM's
names), engine state from the workers, expert routing and KV handoffs (moe_
series). tests/python/test_http.py runs every query of it through a real
Prometheus, so edit this script and run it rather than the JSON.

    deploy/dashboards/make_dashboard.py
"""
import json
import os


def sel(extra=""):
    return '{model_name=~"$model"%s}' % (("," + extra) if extra else "")


QUANTILE = 'histogram_quantile(%s, sum by (le) (rate(%s_bucket%s[$__rate_interval])))'
panels = []


def ts(title, targets, unit="short", w=12, desc=""):
    panels.append({"type": "timeseries", "title": title, "description": desc,
                   "datasource": {"type": "prometheus", "uid": "${datasource}"},
                   "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                   "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                               "tooltip": {"mode": "multi"}},
                   "targets": [{"refId": chr(65 + i), "expr": e, "legendFormat": l}
                               for i, (e, l) in enumerate(targets)],
                   "gridPos": {"w": w, "h": 8}})


def row(title):
    panels.append({"type": "row", "title": title, "collapsed": False, "panels": [],
                   "gridPos": {"w": 24, "h": 1}})


def quantiles(name, qs=("0.5", "0.9", "0.99")):
    return [(QUANTILE % (x, name, sel()), "p%g" % (100 * float(x))) for x in qs]


def rate(name, by="", extra=""):
    grp = "sum by (%s) " % by if by else "sum"
    return "%s(rate(%s%s[$__rate_interval]))" % (grp, name, sel(extra))


row("Requests (coordinators)")
ts("Finished requests / s by finish reason",
   [(rate("vllm:request_success_total", "finished_reason"), "{{finished_reason}}")], "reqps")
ts("Failed requests / s by gRPC code, HTTP answers by status",
   [(rate("moe_request_failures_total", "code"), "failed {{code}}"),
    (rate("moe_http_requests_total", "path, status"), "HTTP {{path}} {{status}}")], "reqps")
ts("Time to first token", quantiles("vllm:time_to_first_token_seconds"), "s")
ts("Inter-token latency", quantiles("vllm:inter_token_latency_seconds"), "s")
ts("End-to-end request latency", quantiles("vllm:e2e_request_latency_seconds"), "s")
ts("Queue / prefill / decode time (p90)",
   [(QUANTILE % ("0.9", "vllm:request_queue_time_seconds", sel()), "queue"),
    (QUANTILE % ("0.9", "vllm:request_prefill_time_seconds", sel()), "prefill"),
    (QUANTILE % ("0.9", "vllm:request_decode_time_seconds", sel()), "decode")], "s")
ts("Tokens / s", [(rate("vllm:prompt_tokens_total"), "prompt"),
                  (rate("vllm:generation_tokens_total"), "generated")])
ts("Requests in flight and workers by state",
   [("sum(moe_coordinator_requests_running%s)" % sel(), "in flight (coordinators)"),
    ("sum by (state) (moe_coordinator_workers%s)" % sel(), "workers {{state}}")])
row("Engines (workers)")
ts("Running and waiting sequences per worker",
   [("sum by (instance) (vllm:num_requests_running%s)" % sel(), "running {{instance}}"),
    ("sum by (instance) (vllm:num_requests_waiting%s)" % sel(), "waiting {{instance}}")])
ts("KV cache usage per worker",
   [("max by (instance) (vllm:kv_cache_usage_perc%s)" % sel(), "{{instance}}")], "percentunit")
ts("Prefix cache hit rate (tokens)",
   [("%s / %s" % (rate("vllm:prefix_cache_hits_total", "instance"),
                  rate("vllm:prefix_cache_queries_total", "instance")), "{{instance}}")],
   "percentunit")
ts("Preemptions / s and speculative acceptance",
   [(rate("vllm:num_preemptions_total", "instance"), "preemptions {{instance}}"),
    ("%s / %s" % (rate("vllm:spec_decode_num_accepted_tokens_total"),
                  rate("vllm:spec_decode_num_draft_tokens_total")), "draft acceptance")])
ts("Engine step time", quantiles("moe_step_duration_seconds"), "s")
ts("Tokens per step", quantiles("vllm:iteration_tokens_total", ("0.5", "0.9")))
ts("Forward time by phase (share of wall time)",
   [(rate("moe_forward_phase_seconds_total", "phase"), "{{phase}}")], "percentunit",
   desc="dispatch and combine hold the expert-parallel all-to-alls")
ts("Step phase p90",
   [("histogram_quantile(0.9, sum by (le, phase) (rate(moe_step_phase_seconds_bucket%s"
     "[$__rate_interval])))" % sel(), "{{phase}}")], "s")
row("Experts and KV handoffs")
ts("Tokens routed per expert (layer $layer)",
   [(rate("moe_expert_tokens_total", "expert", 'layer=~"$layer"'), "expert {{expert}}")],
   "short", 24)
ts("Expert rows per rank and all-to-all bytes",
   [(rate("moe_rank_expert_rows_total", "instance, rank"), "rows {{instance}} rank {{rank}}"),
    (rate("moe_ep_all_to_all_bytes_total", "instance"), "all-to-all bytes {{instance}}")])
ts("Placement epoch", [("max by (instance) (moe_placement_epoch%s)" % sel(), "{{instance}}")])
ts("KV handoffs / s, failures by reason",
   [(rate("moe_kv_handoff_total"), "completed"),
    (rate("moe_kv_handoff_failures_total", "reason"), "failed: {{reason}}"),
    (rate("moe_kv_transfer_failures_total", "instance"), "worker failures {{instance}}")], "ops")
ts("KV handoff latency and bytes",
   [(QUANTILE % ("0.9", "moe_kv_handoff_seconds", sel()), "p90 seconds"),
    (rate("moe_kv_transfer_bytes_total", "direction"), "bytes/s {{direction}}")])

# Two panels per line, rows across.
x = y = 0
for p in panels:
    w, h = p["gridPos"]["w"], p["gridPos"]["h"]
    if p["type"] == "row" or x + w > 24:
        y += 8 if x else 0
        x = 0
    p["gridPos"].update({"x": x, "y": y})
    if p["type"] == "row":
        y += 1
    else:
        x += w
        if x >= 24:
            x, y = 0, y + h
for i, p in enumerate(panels):
    p["id"] = i + 1


def variable(name, label, query, multi):
    return {"name": name, "type": "query", "label": label,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": name}, "definition": query,
            "includeAll": True, "multi": multi, "refresh": 2,
            "current": {"text": "All", "value": "$__all"}}


dash = {
    "title": "moe-serve", "uid": "moe-serve", "schemaVersion": 39, "version": 1,
    "tags": ["moe-serve", "vllm", "llm"], "timezone": "browser", "editable": True,
    "time": {"from": "now-1h", "to": "now"}, "refresh": "10s",
    "description": __doc__.split("\n\n")[0].replace("\n", " "),
    "templating": {"list": [
        {"name": "datasource", "type": "datasource", "query": "prometheus",
         "label": "Prometheus"},
        variable("model", "model", "label_values(vllm:num_requests_running, model_name)", True),
        variable("layer", "MoE layer", "label_values(moe_expert_tokens_total, layer)", False),
    ]},
    "annotations": {"list": []},
    "panels": panels,
}
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe-serve.json")
with open(out, "w") as f:
    json.dump(dash, f, indent=2)
    f.write("\n")
print("%s: %d panels" % (out, len(panels)))
