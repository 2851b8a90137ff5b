// Sluicegate admin UI: progressive enhancements only; every page works without this file.
"use strict";

document.addEventListener("click", async (event) => {
  const button = event.target.closest("[data-copy]");
  if (!button) return;
  const field = document.querySelector(button.dataset.copy);
  const status = document.querySelector("[data-copied]");
  field.select();
  let copied = false;
  try {
    await navigator.clipboard.writeText(field.value);
    copied = true;
  } catch (_) {
    copied = document.execCommand && document.execCommand("copy");
  }
  button.textContent = copied ? "Copied" : "Copy";
  if (status) status.textContent = copied ? "Copied to the clipboard." : "Select the text and copy it (Ctrl+C / ⌘C).";
});

document.addEventListener("submit", (event) => {
  const form = event.target.closest("form[data-confirm]");
  if (form && !window.confirm(form.dataset.confirm)) event.preventDefault();
});
