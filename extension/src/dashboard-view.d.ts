// The notebook dashboard's ES module (an anywidget view), imported as is.
declare module '*/_dashboard.js' {
  const view: { render(args: { model: unknown; el: HTMLElement }): void };
  export default view;
}
