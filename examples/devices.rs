//! Lists RDMA devices with their main device and port attributes.
//!
//! `devices` exits 0 with one block per device, or 1 with a message when there is none.

fn main() {
    let devices = match rdma_reactor::devices() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("devices: cannot list RDMA devices: {e}");
            std::process::exit(1);
        }
    };
    if devices.is_empty() {
        eprintln!("devices: no RDMA device found (is a driver loaded? try `rdma link show`)");
        std::process::exit(1);
    }
    for d in &devices {
        println!("{}", d.name);
        println!("    node_guid       {:016x}", d.node_guid);
        println!("    fw_ver          {}", if d.fw_ver.is_empty() { "-" } else { &d.fw_ver });
        println!("    vendor          {:#x}:{:#x}", d.vendor_id, d.vendor_part_id);
        println!("    max_mr_size     {}", d.max_mr_size);
        println!("    max_qp          {} (max_qp_wr {}, max_sge {})", d.max_qp, d.max_qp_wr, d.max_sge);
        println!("    max_cq          {} (max_cqe {})", d.max_cq, d.max_cqe);
        println!("    max_mr          {}    max_pd {}    max_srq {}", d.max_mr, d.max_pd, d.max_srq);
        println!("    max_qp_rd_atom  {}", d.max_qp_rd_atom);
        for p in &d.ports {
            println!(
                "    port {}: {:?}, {:?}, active_mtu {}, max_mtu {}, gid_table {}, max_msg {}",
                p.port, p.state, p.link_layer, p.active_mtu, p.max_mtu, p.gid_table_len, p.max_msg_size
            );
        }
    }
}
