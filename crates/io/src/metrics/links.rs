//! The links between the GPUs as metrics (issue 24): the fabric, NVLinks, PCIe link,
//! persistence mode and clock-event reasons of each GPU, and the EFA / RDMA ports, from the
//! views the link probes write at each look (`links.json`, `ports.json`: [`StateDir`]). Read
//! at each scrape, like the per-task use: a GPU or port the latest view no longer lists has no
//! series, and `links_view_age_seconds` says how old each view is (a view that stops being
//! rewritten, because the poll or the watch stopped, shows as growing age, not as health).

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::Labels;
use crate::config::{StateDir, View};
use crate::model::links::{GpuLinks, Port};

/// The series of the link views.
#[derive(Default)]
pub(super) struct LinkMetrics {
    fabric_state: Family<Labels, Gauge>,
    fabric_status: Family<Labels, Gauge>,
    nvlinks: Family<Labels, Gauge>,
    nvlinks_down: Family<Labels, Gauge>,
    nvlink_errors: Family<Labels, Gauge>,
    pcie_generation: Family<Labels, Gauge>,
    pcie_width: Family<Labels, Gauge>,
    pcie_replays: Family<Labels, Gauge>,
    persistence: Family<Labels, Gauge>,
    clock_events: Family<Labels, Gauge>,
    port_active: Family<Labels, Gauge>,
    port_errors: Family<Labels, Gauge>,
    view_age: Family<Labels, Gauge>,
}

fn gpu(index: u32) -> Labels {
    vec![("gpu".into(), index.to_string())]
}

fn with(mut labels: Labels, key: &str, value: &str) -> Labels {
    labels.push((key.into(), value.into()));
    labels
}

fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl LinkMetrics {
    pub(super) fn register(registry: &mut Registry) -> Self {
        let m = LinkMetrics::default();
        let series: [(&str, &str, &Family<Labels, Gauge>); 13] = [
            (
                "gpu_fabric_state",
                "1 for the GPU's NVLink fabric registration state (not-started, in-progress, completed), at the last poll; GPUs without a fabric have none",
                &m.fabric_state,
            ),
            (
                "gpu_fabric_status",
                "The fabric registration's status (an nvmlReturn_t: 0 success), at the last poll",
                &m.fabric_status,
            ),
            (
                "gpu_nvlinks",
                "NVLinks of the GPU that answered, at the last poll",
                &m.nvlinks,
            ),
            (
                "gpu_nvlinks_down",
                "NVLinks of the GPU that were up and are down, at the last poll",
                &m.nvlinks_down,
            ),
            (
                "gpu_nvlink_errors_per_minute",
                "NVLink errors per minute over [links] nvlink_window on the GPU's worst link, by counter (crc, replay, recovery)",
                &m.nvlink_errors,
            ),
            (
                "gpu_pcie_link_generation",
                "The GPU's PCIe link generation, current and max (link=\"current\"|\"max\")",
                &m.pcie_generation,
            ),
            (
                "gpu_pcie_link_width",
                "The GPU's PCIe link width in lanes, current and max (link=\"current\"|\"max\")",
                &m.pcie_width,
            ),
            (
                "gpu_pcie_replays_per_minute",
                "PCIe replays per minute over [links] pcie_window",
                &m.pcie_replays,
            ),
            (
                "gpu_persistence_mode",
                "1 while the GPU's persistence mode is on, 0 off (absent: NVML did not say)",
                &m.persistence,
            ),
            (
                "gpu_clock_event_reasons",
                "1 for each clock-event (throttle) reason active at the last poll, by reason",
                &m.clock_events,
            ),
            (
                "rdma_port_active",
                "1 while an EFA / RDMA port's state is ACTIVE, else 0 (state: the sysfs name)",
                &m.port_active,
            ),
            (
                "rdma_port_errors",
                "An EFA / RDMA port's error counter as sysfs hw_counters/counters show it (cumulative since the driver loaded)",
                &m.port_errors,
            ),
            (
                "links_view_age_seconds",
                "Seconds since the link probes last wrote their view (view=\"links\": the NVML poll, \"ports\": the port watch)",
                &m.view_age,
            ),
        ];
        for (name, help, family) in series {
            registry.register(name, help, family.clone());
        }
        m
    }

    /// Replaces the series with what the views in `files` say now.
    pub(super) fn refresh(&self, files: &StateDir) {
        for f in [
            &self.fabric_state,
            &self.fabric_status,
            &self.nvlinks,
            &self.nvlinks_down,
            &self.nvlink_errors,
            &self.pcie_generation,
            &self.pcie_width,
            &self.pcie_replays,
            &self.persistence,
            &self.clock_events,
            &self.port_active,
            &self.port_errors,
            &self.view_age,
        ] {
            f.clear();
        }
        if let Some((gpus, age)) = files.load_view_aged::<Vec<GpuLinks>>(View::Links) {
            self.view_age
                .get_or_create(&vec![("view".into(), "links".into())])
                .set(int(age));
            for g in &gpus {
                self.gpu(g);
            }
        }
        if let Some((ports, age)) = files.load_view_aged::<Vec<Port>>(View::Ports) {
            self.view_age
                .get_or_create(&vec![("view".into(), "ports".into())])
                .set(int(age));
            for p in &ports {
                self.port(p);
            }
        }
    }

    fn gpu(&self, g: &GpuLinks) {
        let l = gpu(g.index);
        if let Some(state) = &g.fabric_state {
            self.fabric_state
                .get_or_create(&with(l.clone(), "state", state))
                .set(1);
            self.fabric_status
                .get_or_create(&l)
                .set(i64::from(g.fabric_status));
        }
        if g.nvlinks > 0 {
            self.nvlinks.get_or_create(&l).set(i64::from(g.nvlinks));
            self.nvlinks_down
                .get_or_create(&l)
                .set(g.nvlinks_down.len() as i64);
            for (counter, v) in [
                ("crc", g.nvlink_crc_per_min),
                ("replay", g.nvlink_replay_per_min),
                ("recovery", g.nvlink_recovery_per_min),
            ] {
                self.nvlink_errors
                    .get_or_create(&with(l.clone(), "counter", counter))
                    .set(int(v));
            }
        }
        let [cur_gen, cur_width, max_gen, max_width] = g.pcie;
        for (family, link, v) in [
            (&self.pcie_generation, "current", cur_gen),
            (&self.pcie_generation, "max", max_gen),
            (&self.pcie_width, "current", cur_width),
            (&self.pcie_width, "max", max_width),
        ] {
            if v > 0 {
                family
                    .get_or_create(&with(l.clone(), "link", link))
                    .set(i64::from(v));
            }
        }
        if g.pcie != [0; 4] {
            self.pcie_replays
                .get_or_create(&l)
                .set(int(g.pcie_replays_per_min));
        }
        if let Some(on) = g.persistence {
            self.persistence.get_or_create(&l).set(i64::from(on));
        }
        for reason in &g.clock_event_reasons {
            self.clock_events
                .get_or_create(&with(l.clone(), "reason", reason))
                .set(1);
        }
    }

    fn port(&self, p: &Port) {
        let l: Labels = vec![
            ("device".into(), p.device.clone()),
            ("port".into(), p.port.clone()),
        ];
        self.port_active
            .get_or_create(&with(l.clone(), "state", &p.state))
            .set(i64::from(p.state == "ACTIVE"));
        for (counter, v) in &p.errors {
            self.port_errors
                .get_or_create(&with(l.clone(), "counter", counter))
                .set(int(*v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(m: &LinkMetrics, registry: &Registry, files: &StateDir) -> String {
        m.refresh(files);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, registry).unwrap();
        out
    }

    #[test]
    fn views_become_series_and_what_a_view_drops_goes_away() {
        let dir = tempfile::tempdir().unwrap();
        let files = StateDir::new(dir.path());
        let mut registry = Registry::with_prefix("gpu_medic");
        let m = LinkMetrics::register(&mut registry);
        // No view written yet: no series at all (not zeros that would read as healthy).
        let out = render(&m, &registry, &files);
        assert!(!out.contains("gpu_medic_gpu_nvlinks{"), "{out}");
        assert!(!out.contains("gpu_medic_links_view_age_seconds{"), "{out}");

        let gpus = [
            GpuLinks {
                index: 0,
                fabric_state: Some("in-progress".into()),
                nvlinks: 18,
                nvlinks_down: vec![4],
                nvlink_crc_per_min: 7000,
                pcie: [4, 8, 5, 16],
                pcie_replays_per_min: 3,
                persistence: Some(false),
                clock_event_reasons: vec!["sw-thermal-slowdown".into()],
                ..GpuLinks::default()
            },
            GpuLinks {
                index: 1,
                fabric_state: Some("completed".into()),
                fabric_status: 12,
                nvlinks: 18,
                pcie: [5, 16, 5, 16],
                persistence: Some(true),
                ..GpuLinks::default()
            },
        ];
        std::fs::write(files.links(), serde_json::to_vec(&gpus).unwrap()).unwrap();
        let ports = [Port {
            device: "rdmap16s27".into(),
            port: "1".into(),
            state: "DOWN".into(),
            errors: [("rx_drops".to_string(), 42u64)].into_iter().collect(),
        }];
        std::fs::write(files.ports(), serde_json::to_vec(&ports).unwrap()).unwrap();
        let out = render(&m, &registry, &files);
        for line in [
            "gpu_medic_gpu_fabric_state{gpu=\"0\",state=\"in-progress\"} 1",
            "gpu_medic_gpu_fabric_state{gpu=\"1\",state=\"completed\"} 1",
            "gpu_medic_gpu_fabric_status{gpu=\"1\"} 12",
            "gpu_medic_gpu_nvlinks{gpu=\"0\"} 18",
            "gpu_medic_gpu_nvlinks_down{gpu=\"0\"} 1",
            "gpu_medic_gpu_nvlinks_down{gpu=\"1\"} 0",
            "gpu_medic_gpu_nvlink_errors_per_minute{gpu=\"0\",counter=\"crc\"} 7000",
            "gpu_medic_gpu_pcie_link_generation{gpu=\"0\",link=\"current\"} 4",
            "gpu_medic_gpu_pcie_link_generation{gpu=\"0\",link=\"max\"} 5",
            "gpu_medic_gpu_pcie_link_width{gpu=\"0\",link=\"current\"} 8",
            "gpu_medic_gpu_pcie_link_width{gpu=\"0\",link=\"max\"} 16",
            "gpu_medic_gpu_pcie_replays_per_minute{gpu=\"0\"} 3",
            "gpu_medic_gpu_persistence_mode{gpu=\"0\"} 0",
            "gpu_medic_gpu_persistence_mode{gpu=\"1\"} 1",
            "gpu_medic_gpu_clock_event_reasons{gpu=\"0\",reason=\"sw-thermal-slowdown\"} 1",
            "gpu_medic_rdma_port_active{device=\"rdmap16s27\",port=\"1\",state=\"DOWN\"} 0",
            "gpu_medic_rdma_port_errors{device=\"rdmap16s27\",port=\"1\",counter=\"rx_drops\"} 42",
            "gpu_medic_links_view_age_seconds{view=\"links\"}",
            "gpu_medic_links_view_age_seconds{view=\"ports\"}",
        ] {
            assert!(out.contains(line), "{line} missing:\n{out}");
        }
        assert!(
            !out.contains("gpu_medic_gpu_clock_event_reasons{gpu=\"1\""),
            "{out}"
        );

        // The next look lists one GPU and a port back up: the other GPU's series are gone.
        std::fs::write(files.links(), serde_json::to_vec(&gpus[1..]).unwrap()).unwrap();
        let up = [Port {
            state: "ACTIVE".into(),
            ..ports[0].clone()
        }];
        std::fs::write(files.ports(), serde_json::to_vec(&up).unwrap()).unwrap();
        let out = render(&m, &registry, &files);
        assert!(!out.contains("gpu=\"0\""), "{out}");
        assert!(
            out.contains(
                "gpu_medic_rdma_port_active{device=\"rdmap16s27\",port=\"1\",state=\"ACTIVE\"} 1"
            ),
            "{out}"
        );
        assert!(!out.contains("state=\"DOWN\""), "{out}");
    }
}
