# Packer provisioners that bake gpu-medic into an AMI built from the ECS GPU-optimized AL2023
# AMI. Merge the two provisioners into your template's build block (the `sources` line names
# your own amazon-ebs source). With aws/amazon-ecs-ami's own recipe, you can instead drop the
# RPM into additional-packages/ (installed by scripts/install-additional-packages.sh, the name
# must end in .x86_64.rpm) and keep only the enable step.

variable "gpu_medic_rpm" {
  type        = string
  description = "Path of the RPM built by scripts/packaging-build.sh"
  default     = "target/generate-rpm/gpu-medic-0.1.0-1.x86_64.rpm"
}

build {
  sources = ["source.amazon-ebs.ecs_gpu"]

  provisioner "file" {
    source      = var.gpu_medic_rpm
    destination = "/tmp/gpu-medic.x86_64.rpm"
  }

  provisioner "shell" {
    inline_shebang = "/bin/bash -e"
    inline = [
      "sudo dnf install -y /tmp/gpu-medic.x86_64.rpm",
      "rm -f /tmp/gpu-medic.x86_64.rpm",
      # Enabled, not started: it starts on the first boot of the AMI.
      "sudo systemctl enable gpu-medic.service",
      "sudo systemd-analyze verify /usr/lib/systemd/system/gpu-medic.service",
      "/usr/bin/gpu-medic --version",
      "/usr/bin/gpu-medic policy check /etc/gpu-medic/policies/default.toml",
      # No state from the build instance in the image.
      "sudo find /var/lib/gpu-medic -mindepth 1 -delete",
    ]
  }
}
